"""Streaming detokenization: token pieces (bytes) in, safe text out.

Two rules, both needed for streaming:
- never split a UTF-8 character: incomplete trailing bytes wait for the next
  piece (bytes that can never form a character become U+FFFD; an incomplete
  character left when generation ends is dropped);
- never emit text past a stop string: text that could be the start of a stop
  string is held back until the next piece decides it.
"""

from __future__ import annotations

import codecs
from typing import Optional, Sequence


class TextStream:
    def __init__(self, stop: Sequence[str] = ()):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = [s for s in stop if s]
        self._held = ""  # decoded text not yet released (could begin a stop string)
        self.text = ""  # all text released so far
        self.stopped_by: Optional[str] = None

    def push(self, piece: bytes) -> str:
        """Add one token's bytes; return the text that is now safe to emit.
        After a stop string matched, ``stopped_by`` is set and nothing more is emitted."""
        if self.stopped_by is not None:
            return ""
        pending = self._held + self._decoder.decode(piece)
        cut = self._first_stop(pending)
        if cut is not None:
            out = pending[:cut]
            self._held = ""
            self.text += out
            return out
        keep = self._longest_stop_prefix_suffix(pending)
        out = pending[: len(pending) - keep]
        self._held = pending[len(pending) - keep :]
        self.text += out
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
        self.text += out
        return out

    def _first_stop(self, text: str) -> Optional[int]:
        best: Optional[int] = None
        for s in self._stop:
            i = text.find(s)
            if i >= 0 and (best is None or i < best):
                best, self.stopped_by = i, s
        return best

    def _longest_stop_prefix_suffix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        longest = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest
