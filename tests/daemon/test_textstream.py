"""Streaming detokenization: UTF-8 is never split, text never passes a stop string."""

import pytest

from tandem.daemon.textstream import TextStream


def feed(stream: TextStream, pieces):
    out = [stream.push(p) for p in pieces]
    out.append(stream.flush())
    return out


def test_multibyte_character_split_across_pieces_is_held_until_complete():
    smile = "🙂".encode()  # 4 bytes
    out = feed(TextStream(), [b"a", smile[:1], smile[1:3], smile[3:], b"b"])
    assert out == ["a", "", "", "🙂", "b", ""]


def test_incomplete_character_at_the_end_is_dropped():
    out = feed(TextStream(), [b"x", "é".encode()[:1]])
    assert "".join(out) == "x"


def test_bytes_that_can_never_be_utf8_become_replacement_characters():
    out = feed(TextStream(), [b"a\xff", b"b"])
    assert "".join(out) == "a\ufffdb"


CASES = [
    # (stop strings, pieces, emitted text, stopped_by)
    (["END"], [b"abc", b"E", b"N", b"D", b"zzz"], "abc", "END"),
    (["END"], [b"abcEN", b"Dzzz"], "abc", "END"),
    (["END"], [b"abcE", b"Nope"], "abcENope", None),
    (["\n\n"], [b"line\n", b"\nnext"], "line", "\n\n"),
    (["ab", "b"], [b"xab"], "x", "ab"),
    (["b", "ab"], [b"xab"], "x", "ab"),
    (["世界"], ["hello 世".encode(), "界!".encode()], "hello ", "世界"),
    ([], [b"plain"], "plain", None),
]


@pytest.mark.parametrize("stop,pieces,text,stopped_by", CASES)
def test_stop_strings(stop, pieces, text, stopped_by):
    stream = TextStream(stop)
    out = feed(stream, pieces)
    assert "".join(out) == text == stream.text
    assert stream.stopped_by == stopped_by


def test_text_that_may_start_a_stop_string_is_held_back_then_released():
    stream = TextStream(["STOP"])
    assert stream.push(b"go ST") == "go "
    assert stream.push(b"ILL") == "STILL"
    assert stream.stopped_by is None


def test_nothing_is_emitted_after_a_stop():
    stream = TextStream(["x"])
    assert stream.push(b"ax") == "a"
    assert stream.push(b"more") == ""
    assert stream.flush() == ""
