"""Streaming detokenization: UTF-8 is never split, text never passes a stop string."""

import pytest

from tandem.daemon.worker.textstream import BLANK_LINE, LINE_LIMIT, TextStream


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


def _run(pieces, **rules):
    stream = TextStream(**rules)
    emitted = ""
    for piece in pieces:
        emitted += stream.push(piece.encode())
        if stream.stopped_by is not None:
            break
    emitted += stream.flush()
    assert emitted == stream.text
    return stream.text, stream.stopped_by


@pytest.mark.parametrize(
    "pieces, rules, text, stopped_by",
    [
        # a blank line ends a completion; the newline before it is dropped
        (
            ["x = 1", "\n", "    ", "y", "\n", "  ", "\n", "z"],
            dict(stop_at_blank_line=True),
            "x = 1\n    y",
            BLANK_LINE,
        ),
        (["a\n\nb"], dict(stop_at_blank_line=True), "a", BLANK_LINE),
        (["a\n\t \n"], dict(stop_at_blank_line=True), "a", BLANK_LINE),
        # an indented line is not blank; a trailing newline is released at the end
        (["a\n", "  b\n"], dict(stop_at_blank_line=True), "a\n  b\n", None),
        (["a\n\nb"], dict(), "a\n\nb", None),
        # max_lines counts lines across pieces
        (["a\nb\nc\nd"], dict(max_lines=2), "a\nb", LINE_LIMIT),
        (["a\n", "b\n", "c\n"], dict(max_lines=2), "a\nb", LINE_LIMIT),
        (["a", "b\n", "c"], dict(max_lines=1), "ab", LINE_LIMIT),
        (["a\nb"], dict(max_lines=5), "a\nb", None),
        # the earliest rule wins
        (["ab", "c END\n\n"], dict(stop=["END"], stop_at_blank_line=True), "abc ", "END"),
        (["a\n\nEND"], dict(stop=["END"], stop_at_blank_line=True), "a", BLANK_LINE),
        (["a\nb\n\n"], dict(stop_at_blank_line=True, max_lines=1), "a", LINE_LIMIT),
    ],
)
def test_line_rules_of_inline_completion(pieces, rules, text, stopped_by):
    assert _run(pieces, **rules) == (text, stopped_by)


def test_a_line_that_may_turn_blank_is_held_back_until_decided():
    stream = TextStream(stop_at_blank_line=True)
    assert stream.push(b"a\n") == "a"
    assert stream.push(b"  ") == ""  # "\n  " could still become a blank line
    assert stream.push(b"b") == "\n  b"
