"""The decoding loop, driven by a scripted stand-in model (pure logic; the real
model is exercised end to end in tests/integration)."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.daemon.engine import Engine, RequestError
from tandem.daemon.interfaces import DecodeAborted
from tandem.protocol import ChatMessage, Complete, ErrorCode, FinishReason, Generate

EOS = 0


class ScriptedModel:
    """Tokens are bytes: token t (1..255) is the byte t. Greedily, it continues
    the prompt with ``script``, then EOS, whatever it is fed (so drafts that
    match the script are accepted)."""

    n_ctx_train = 64

    def __init__(self, script: bytes, n_ctx: int = 64):
        self.script = list(script)
        self.n_ctx = n_ctx
        self.decoded: list[list[int]] = []
        self.n_past = 0
        self.prompt_len = 0

    def tokenize(self, text, add_special, parse_special=True):
        return list(text.encode())

    def piece(self, token):
        return bytes([token])

    def is_eog(self, token):
        return token == EOS

    def fim_tokens(self):
        return None

    def clear(self):
        self.n_past = 0
        self.prompt_len = 0

    def truncate(self, n_keep):
        self.n_past = min(self.n_past, n_keep)

    def decode(self, tokens, logits_for=(-1,), abort=None):
        if len(tokens) > 4 and abort is not None and abort():  # a "long prefill" of several batches
            raise DecodeAborted()
        if self.n_past == 0:
            self.prompt_len = len(tokens)
        self.decoded.append(list(tokens))
        rows = []
        for i in logits_for:
            pos = self.n_past + (i % len(tokens))
            step = pos + 1 - self.prompt_len
            logits = np.zeros(256, dtype=np.float32)
            logits[self.script[step] if step < len(self.script) else EOS] = 10.0
            rows.append(logits)
        self.n_past += len(tokens)
        return np.stack(rows)


def run(model, cancel_after=None, **params):
    req = Generate(id="r", prompt=params.pop("prompt", "hi"), temperature=0.0, **params)
    chunks = []

    def should_cancel():
        return cancel_after is not None and len(chunks) >= cancel_after

    done = Engine(model, None).run(req, chunks.append, should_cancel)
    return done, chunks


def test_generates_until_end_of_generation():
    done, chunks = run(ScriptedModel(b"hello"))
    assert done.text == "hello" and done.finish_reason == FinishReason.STOP
    assert "".join(c.text for c in chunks) == "hello"
    assert [t for c in chunks for t in c.token_ids] == list(b"hello")
    assert done.usage.prompt_tokens == 2 and done.usage.completion_tokens == 5


def test_max_tokens():
    done, _ = run(ScriptedModel(b"hello world"), max_tokens=3)
    assert done.text == "hel" and done.finish_reason == FinishReason.LENGTH


def test_ignore_eos_keeps_going():
    done, _ = run(ScriptedModel(b"ab"), max_tokens=4, ignore_eos=True)
    assert done.usage.completion_tokens == 4 and done.finish_reason == FinishReason.LENGTH


def test_context_full_ends_with_length():
    done, _ = run(ScriptedModel(b"x" * 100, n_ctx=10), prompt="abcdef")
    assert done.usage.completion_tokens == 4 and done.finish_reason == FinishReason.LENGTH


def test_stop_string():
    done, _ = run(ScriptedModel(b"one, two, three"), stop=[", th"])
    assert done.text == "one, two" and done.finish_reason == FinishReason.STOP


def test_cancel_ends_within_one_decode_step():
    model = ScriptedModel(b"x" * 50)
    done, chunks = run(model, cancel_after=3)
    assert done.finish_reason == FinishReason.CANCELLED
    assert len(chunks) == 3
    assert len(model.decoded) == 3  # the prefill and two steps: no decode after the cancel


def test_prompt_too_long_names_the_limit():
    with pytest.raises(RequestError) as info:
        run(ScriptedModel(b"x", n_ctx=8), prompt="123456789")
    assert info.value.code == ErrorCode.PROMPT_TOO_LONG
    assert "9 tokens" in info.value.message and "8" in info.value.message and "--ctx-size" in info.value.message


def test_messages_without_a_chat_template_are_refused():
    req = Generate(id="r", messages=[ChatMessage("user", "hi")])
    with pytest.raises(RequestError) as info:
        Engine(ScriptedModel(b"x"), None).run(req, lambda c: None, lambda: False)
    assert info.value.code == ErrorCode.CHAT_TEMPLATE and "--raw" in info.value.message


def test_no_chunks_when_not_streaming():
    done, chunks = run(ScriptedModel(b"abc"), stream=False)
    assert chunks == [] and done.text == "abc"


def test_cancel_during_a_long_prefill():
    model = ScriptedModel(b"abc")
    done, chunks = run(model, cancel_after=0, prompt="a long prompt")
    assert done.finish_reason == FinishReason.CANCELLED and chunks == []
    assert done.usage.prompt_tokens == 13 and done.usage.completion_tokens == 0
    assert model.decoded == []


class FimModel(ScriptedModel):
    """With fill-in-the-middle tokens: bytes 1, 2, 3 (never text here)."""

    def fim_tokens(self):
        return (1, 2, 3)


def test_fim_prompt_is_prefix_suffix_middle_in_the_models_tokens():
    engine = Engine(FimModel(b""), None)
    assert engine.fim_prompt(Complete(id="r", prefix="ab", suffix="cd")) == [1, 97, 98, 2, 99, 100, 3]


@pytest.mark.parametrize(
    "prefix, suffix, kept_prefix, kept_suffix",
    [
        (100, 100, 40, 13),  # both long: the suffix gets a quarter of the room, the prefix the rest
        (10, 100, 10, 43),  # a short prefix leaves the rest to the suffix
        (100, 5, 48, 5),
        (20, 20, 20, 20),  # fits: untouched
    ],
)
def test_fim_prompt_cuts_a_file_too_long_for_the_context_around_the_cursor(prefix, suffix, kept_prefix, kept_suffix):
    # room = 64 context - 3 FIM tokens - 8 for the answer = 53
    tokens = Engine(FimModel(b"", n_ctx=64), None).fim_prompt(Complete(id="r", prefix="a" * prefix, suffix="b" * suffix, max_tokens=8))
    middle = tokens.index(2)
    assert tokens[0] == 1 and tokens[-1] == 3
    assert tokens[1:middle] == [97] * kept_prefix  # the end of the prefix (all "a" here)
    assert tokens[middle + 1 : -1] == [98] * kept_suffix


def test_complete_stops_at_a_blank_line_and_a_model_without_fim_tokens_is_refused():
    req = Complete(id="r", prefix="x = ", suffix="\n")
    done = Engine(FimModel(b"1\n\ny = 2"), None).run(req, lambda chunk: None, lambda: False)
    assert done.text == "1" and done.finish_reason == FinishReason.STOP
    with pytest.raises(RequestError) as err:
        Engine(ScriptedModel(b"1"), None).run(req, lambda chunk: None, lambda: False)
    assert err.value.code == ErrorCode.FIM_UNSUPPORTED and "qwen2.5-coder" in err.value.message
