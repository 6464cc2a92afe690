"""Fill in the middle (the ``complete`` op) through the real daemon: Qwen2.5-Coder-0.5B
(FIM tokens), and SmolLM2 (none: a clear error)."""

from __future__ import annotations

import pytest

from tandem.client import RequestFailed
from tandem.protocol import ErrorCode

CTX = 2048
PREFIX = "def add(a, b):\n    return "
SUFFIX = "\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"


def source_file(functions: int) -> str:
    """A Python module of similar small functions (about 45 tokens each)."""
    return (
        "\n\n".join(
            f'def scale_{i}(values, factor={i}):\n    """Multiply each value by {i}."""\n'
            f"    return [v * factor for v in values]"
            for i in range(functions)
        )
        + "\n"
    )


@pytest.fixture(scope="module")
def coder(coder_daemon):
    return coder_daemon


def test_complete_fills_the_middle_and_streams_what_done_says(coder):
    with coder.client() as c:
        assert c.status().model.fim is True
        stream = c.infill(PREFIX, SUFFIX)
        chunks = [ch.text for ch in stream]
    done = stream.done
    assert "a + b" in done.text, done.text
    assert "".join(chunks) == done.text
    assert done.finish_reason.value == "stop"
    assert "\n\n" not in done.text  # stop_at_blank_line is on by default
    assert done.usage.prompt_tokens > 3  # the three FIM tokens and the code


def test_greedy_by_default_and_the_same_with_and_without_the_cache(coder):
    with coder.client() as c:
        c.cache_clear()
        cold = c.infill(PREFIX, SUFFIX, cache=False).wait()
        first = c.infill(PREFIX, SUFFIX).wait()
        again = c.infill(PREFIX, SUFFIX).wait()
    assert cold.text == first.text == again.text
    assert first.usage.cached_tokens == 0
    assert again.usage.cached_tokens > 0


def test_the_same_file_with_the_cursor_moved_reuses_the_cached_prefix(coder):
    """An editor sends the whole file on every keystroke; what precedes the cursor is cached."""
    lines = source_file(24).splitlines(keepends=True)
    with coder.client() as c:
        c.cache_clear()
        chunk = c.status().model.prefill_chunk or 16  # what is kept: whole prefill chunks (mixed), else pages
        heads, dones = [], []
        for cursor_line in (40, 48, 56):  # the cursor moves down the file
            head = "".join(lines[:cursor_line])
            heads.append(c.infill(head, "", max_tokens=1, cache=False).wait().usage.prompt_tokens - 3)  # its tokens
            dones.append(c.infill(head + "    ", "".join(lines[cursor_line:]), max_tokens=16).wait())
    assert dones[0].usage.cached_tokens == 0
    for head, later in zip(heads, dones[1:]):
        # the file up to the earlier cursor is cached, in whole prefill chunks
        assert head - chunk - 1 <= later.usage.cached_tokens < later.usage.prompt_tokens
        assert later.usage.cached_tokens % chunk == 0


def test_line_rules(coder):
    with coder.client() as c:
        one = c.infill("import os\n\ndef list_python_files(path):\n", "", max_lines=1, max_tokens=64).wait()
        many = c.infill(
            "import os\n\ndef list_python_files(path):\n", "", stop_at_blank_line=False, max_tokens=48
        ).wait()
    assert "\n" not in one.text and one.text.strip()
    assert one.finish_reason.value == "stop"
    assert many.text.count("\n") >= 1  # without a line limit it goes on past the first line
    assert many.text.startswith(one.text)


def test_fim_token_spellings_in_the_file_are_plain_text(coder):
    """A file that contains '<|fim_middle|>' cannot inject the token: it is read as text."""
    with coder.client() as c:
        plain = c.infill("x = 'A'\n", "", max_tokens=1).wait()
        spelled = c.infill("x = '<|fim_middle|>'\n", "", max_tokens=1).wait()
    assert spelled.usage.prompt_tokens >= plain.usage.prompt_tokens + 4


def test_a_file_longer_than_the_context_is_cut_around_the_cursor(coder):
    text = source_file(120)  # about 5,000 tokens; the context holds 2,048
    middle = len(text) * 3 // 4
    with coder.client() as c:
        done = c.infill(text[:middle], text[middle:], max_tokens=8).wait()
        too_long = None
        try:
            c.complete(prompt=text, max_tokens=8)
        except RequestFailed as exc:
            too_long = exc
    assert done.usage.prompt_tokens == CTX - 8  # cut to fit, with room left for max_tokens
    assert done.usage.completion_tokens == 8
    assert too_long is not None and too_long.code == ErrorCode.PROMPT_TOO_LONG  # generate still refuses


def test_bad_complete_requests_get_typed_errors_and_change_nothing(coder):
    with coder.client() as c:
        before = c.status().requests
        for params in (dict(max_lines=-1), dict(top_p=0.0), dict(max_tokens=0)):
            with pytest.raises(Exception, match="invalid request"):
                c.infill("x", **params)
        assert c.status().requests == before
        assert "a + b" in c.infill(PREFIX, SUFFIX).wait().text


def test_complete_goes_through_the_drafter(start_daemon, coder_path):
    d = start_daemon("--drafter", "ngram", "--ctx-size", str(CTX), "--exact", "on", model=coder_path)
    text = source_file(12)
    cut = text.index("def scale_9")
    with d.client() as c:
        plain = c.infill(text[:cut], text[cut:], draft="off", max_tokens=40, stop_at_blank_line=False).wait()
        drafted = c.infill(text[:cut], text[cut:], draft="on", max_tokens=40, stop_at_blank_line=False).wait()
    assert drafted.draft is not None and drafted.draft.rounds > 0 and drafted.draft.accepted > 0
    assert drafted.text == plain.text  # exact steps: drafting never changes greedy output


def test_a_model_without_fim_tokens_gets_a_clear_error(daemon):
    with daemon.client() as c:
        assert c.status().model.fim is False
        with pytest.raises(RequestFailed) as err:
            c.infill(PREFIX, SUFFIX).wait()
        assert err.value.code == ErrorCode.FIM_UNSUPPORTED
        assert "fill-in-the-middle" in err.value.message and "qwen2.5-coder" in err.value.message
        assert c.complete(prompt=PREFIX, max_tokens=4, temperature=0).usage.completion_tokens > 0  # still serving
