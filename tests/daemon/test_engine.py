"""The decoding loop, driven by a scripted stand-in model (pure logic; the real
model is exercised end to end in tests/integration)."""

from __future__ import annotations

import pytest

from tandem.daemon.worker.engine import Engine, RequestError
from tandem.protocol import ChatMessage, Complete, ErrorCode, FinishReason, Generate


def run(model, cancel_after=None, **params):
    req = Generate(id="r", prompt=params.pop("prompt", "hi"), temperature=0.0, **params)
    chunks = []

    def should_cancel():
        return cancel_after is not None and len(chunks) >= cancel_after

    done = Engine(model, None).run(req, chunks.append, should_cancel)
    return done, chunks


def test_generates_until_end_of_generation(scripted_model):
    done, chunks = run(scripted_model(b"hello"))
    assert done.text == "hello" and done.finish_reason == FinishReason.STOP
    assert "".join(c.text for c in chunks) == "hello"
    assert [t for c in chunks for t in c.token_ids] == list(b"hello")
    assert done.usage.prompt_tokens == 2 and done.usage.completion_tokens == 5


def test_max_tokens(scripted_model):
    done, _ = run(scripted_model(b"hello world"), max_tokens=3)
    assert done.text == "hel" and done.finish_reason == FinishReason.LENGTH


def test_ignore_eos_keeps_going(scripted_model):
    done, _ = run(scripted_model(b"ab"), max_tokens=4, ignore_eos=True)
    assert done.usage.completion_tokens == 4 and done.finish_reason == FinishReason.LENGTH


def test_context_full_ends_with_length(scripted_model):
    done, _ = run(scripted_model(b"x" * 100, n_ctx=10), prompt="abcdef")
    assert done.usage.completion_tokens == 4 and done.finish_reason == FinishReason.LENGTH


def test_stop_string(scripted_model):
    done, _ = run(scripted_model(b"one, two, three"), stop=[", th"])
    assert done.text == "one, two" and done.finish_reason == FinishReason.STOP


def test_cancel_ends_within_one_decode_step(scripted_model):
    model = scripted_model(b"x" * 50)
    done, chunks = run(model, cancel_after=3)
    assert done.finish_reason == FinishReason.CANCELLED
    assert len(chunks) == 3
    assert len(model.decoded) == 3  # the prefill and two steps: no decode after the cancel


def test_prompt_too_long_names_the_limit(scripted_model):
    with pytest.raises(RequestError) as info:
        run(scripted_model(b"x", n_ctx=8), prompt="123456789")
    assert info.value.code == ErrorCode.PROMPT_TOO_LONG
    assert "9 tokens" in info.value.message and "8" in info.value.message and "--ctx-size" in info.value.message


def test_messages_without_a_chat_template_are_refused(scripted_model):
    req = Generate(id="r", messages=[ChatMessage("user", "hi")])
    with pytest.raises(RequestError) as info:
        Engine(scripted_model(b"x"), None).run(req, lambda c: None, lambda: False)
    assert info.value.code == ErrorCode.CHAT_TEMPLATE and "--raw" in info.value.message


def test_no_chunks_when_not_streaming(scripted_model):
    done, chunks = run(scripted_model(b"abc"), stream=False)
    assert chunks == [] and done.text == "abc"


def test_cancel_during_a_long_prefill(scripted_model):
    model = scripted_model(b"abc")
    done, chunks = run(model, cancel_after=0, prompt="a long prompt")
    assert done.finish_reason == FinishReason.CANCELLED and chunks == []
    assert done.usage.prompt_tokens == 13 and done.usage.completion_tokens == 0
    assert model.decoded == []


@pytest.fixture
def fim_model(scripted_model):
    class FimModel(scripted_model):
        """With fill-in-the-middle tokens: bytes 1, 2, 3 (never text here)."""

        def fim_tokens(self):
            return (1, 2, 3)

    return FimModel


def test_fim_prompt_is_prefix_suffix_middle_in_the_models_tokens(fim_model):
    engine = Engine(fim_model(b""), None)
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
def test_fim_prompt_cuts_a_file_too_long_for_the_context_around_the_cursor(
    fim_model, prefix, suffix, kept_prefix, kept_suffix
):
    # room = 64 context - 3 FIM tokens - 8 for the answer = 53
    request = Complete(id="r", prefix="a" * prefix, suffix="b" * suffix, max_tokens=8)
    tokens = Engine(fim_model(b"", n_ctx=64), None).fim_prompt(request)
    middle = tokens.index(2)
    assert tokens[0] == 1 and tokens[-1] == 3
    assert tokens[1:middle] == [97] * kept_prefix  # the end of the prefix (all "a" here)
    assert tokens[middle + 1 : -1] == [98] * kept_suffix


def test_complete_stops_at_a_blank_line_and_a_model_without_fim_tokens_is_refused(scripted_model, fim_model):
    req = Complete(id="r", prefix="x = ", suffix="\n")
    done = Engine(fim_model(b"1\n\ny = 2"), None).run(req, lambda chunk: None, lambda: False)
    assert done.text == "1" and done.finish_reason == FinishReason.STOP
    with pytest.raises(RequestError) as err:
        Engine(scripted_model(b"1"), None).run(req, lambda chunk: None, lambda: False)
    assert err.value.code == ErrorCode.FIM_UNSUPPORTED and "qwen2.5-coder" in err.value.message
