"""Streaming detokenization: token pieces (bytes) in, safe text out.

Two rules, both needed for streaming:
- never split a UTF-8 character: incomplete trailing bytes wait for the next
  piece (bytes that can never form a character become U+FFFD; an incomplete
  character left when generation ends is dropped);
- never emit text past a stop string: text that could be the start of a stop
  string is held back until the next piece decides it.

Inline completion (``complete``) adds two line rules, which stop the same way:
before a blank line (empty, or only spaces and tabs), and before the line
after ``max_lines`` lines. Either cut drops the newline that ends the last line
kept: the text after the cursor usually starts with its own.
"""

from __future__ import annotations

import codecs
import re
from typing import Optional, Sequence

BLANK_LINE = "blank line"  # ``stopped_by`` for the line rules
LINE_LIMIT = "max_lines"
_BLANK = re.compile(r"\n[ \t]*\n")
_OPEN_LINE = re.compile(r"\n[ \t]*\Z")  # a line that may still turn out blank


class TextStream:
    def __init__(self, stop: Sequence[str] = (), stop_at_blank_line: bool = False, max_lines: int = 0):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = [s for s in stop if s]
        self._blank = stop_at_blank_line
        self._max_lines = max_lines  # 0: no limit
        self._newlines = 0  # in ``text``
        self._held = ""  # decoded text not yet released (could begin a stop string)
        self.text = ""  # all text released so far
        self.stopped_by: Optional[str] = None

    def push(self, piece: bytes) -> str:
        """Add one token's bytes; return the text that is now safe to emit.
        After a stop string matched, ``stopped_by`` is set and nothing more is emitted."""
        if self.stopped_by is not None:
            return ""
        pending = self._held + self._decoder.decode(piece)
        cut = self._first_cut(pending)
        if cut is not None:
            out = pending[:cut]
            self._held = ""
            return self._release(out)
        keep = self._longest_stop_prefix_suffix(pending)
        if self._blank:
            line = _OPEN_LINE.search(pending)
            if line is not None:
                keep = max(keep, len(pending) - line.start())
        out = pending[: len(pending) - keep]
        self._held = pending[len(pending) - keep :]
        return self._release(out)

    def _release(self, out: str) -> str:
        self.text += out
        self._newlines += out.count("\n")
        return out

    def flush(self) -> str:
        """End of generation: release whatever is held. An incomplete UTF-8
        sequence at the very end (max_tokens cut a character in half) is dropped,
        not turned into U+FFFD; its token ids were still reported."""
        if self.stopped_by is not None:
            return ""
        out = self._held
        self._held = ""
        self._decoder.reset()
        return self._release(out)

    def _first_cut(self, text: str) -> Optional[int]:
        """Where the earliest stop string or line rule ends ``text`` (setting
        ``stopped_by``), or None."""
        cuts: list[tuple[int, str]] = [(i, s) for s in self._stop if (i := text.find(s)) >= 0]
        if self._blank and (m := _BLANK.search(text)) is not None:
            cuts.append((m.start(), BLANK_LINE))
        if self._max_lines:
            i = -1
            for _ in range(self._max_lines - self._newlines):
                i = text.find("\n", i + 1)
                if i < 0:
                    break
            if i >= 0:
                cuts.append((i, LINE_LIMIT))
        if not cuts:
            return None
        best, self.stopped_by = min(cuts, key=lambda c: c[0])
        return best

    def _longest_stop_prefix_suffix(self, text: str) -> int:
        return held_suffix(text, self._stop)


def held_suffix(text: str, words: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``words``:
    text to hold back, since the next piece may complete the word."""
    longest = 0
    for s in words:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest
