"""Suffix drafting: no model; the longest match in the context, and in what
earlier replies said.

The idea of SuffixDecoding (Oliaro et al., 2024), on one chain of drafts
instead of a tree. Where prompt lookup (ngram.py) matches at most the last 4
tokens and drafts k tokens after whichever occurrence of them came last, this
drafter

- matches the *longest* suffix of the context that occurred before, however
  long: in code, ``    return self.`` occurs everywhere, the 20 tokens before
  it once, so a long match finds the right place in a file being re-emitted;
- drafts as many tokens as the match is long (``factor`` x the match, at most
  k): a 1-token match is weak evidence and a verify pass over k+1 tokens costs
  the target up to 3x one token on a CPU, so a weak match drafts little;
- also matches against the replies of earlier requests (a bounded memory of
  ``memory_tokens``), so what an agent wrote in a turn whose history it did
  not re-send, or the shape of its every tool call, is there to copy;
- keeps its index across requests when the new prompt extends the context of
  the request before (an agent's next turn): it reads only the new tokens.

Both indexes are suffix automata (Blumer et al., 1985): every substring of the
text is one path from the root, built online in amortised O(1) per token. The
proposals are deterministic, so their q is one-hot.
"""

from __future__ import annotations

from typing import Optional, Sequence

from .interfaces import Drafter
from .speculative import SparseDist

# Updating "the latest earlier occurrence" walks this many suffix classes up
# from each new token; classes further up keep an older occurrence (still a
# real one): after a run of more than this many equal tokens, a short match may
# draft from an older occurrence than the latest.
RECENCY_WALK = 16


class SuffixAutomaton:
    """The suffix automaton of a token sequence, with for each state the end
    position of its latest occurrence before the text's end (``prev_end``)."""

    __slots__ = ("next", "link", "length", "end", "prev_end", "last", "tokens")

    def __init__(self, tokens: Sequence[int] = ()):
        self.next: list[dict[int, int]] = [{}]
        self.link: list[int] = [-1]
        self.length: list[int] = [0]
        self.end: list[int] = [-1]  # latest end position (index of the last token) of the state's strings
        self.prev_end: list[int] = [-1]  # the one before it
        self.last = 0
        self.tokens: list[int] = []
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def _state(self, length: int, end: int, prev_end: int, link: int, nxt: dict[int, int]) -> int:
        self.next.append(nxt)
        self.link.append(link)
        self.length.append(length)
        self.end.append(end)
        self.prev_end.append(prev_end)
        return len(self.length) - 1

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.append(t)

    def append(self, t: int) -> None:
        nxt, link, length = self.next, self.link, self.length
        pos = len(self.tokens)
        self.tokens.append(t)
        cur = self._state(length[self.last] + 1, pos, -1, -1, {})
        p = self.last
        while p != -1 and t not in nxt[p]:
            nxt[p][t] = cur
            p = link[p]
        if p == -1:
            link[cur] = 0
        else:
            q = nxt[p][t]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:
                clone = self._state(length[p] + 1, self.end[q], self.prev_end[q], link[q], dict(nxt[q]))
                while p != -1 and nxt[p].get(t) == q:
                    nxt[p][t] = clone
                    p = link[p]
                link[q] = link[cur] = clone
        self.last = cur
        # the classes that just gained an occurrence at pos (cur's suffixes): their
        # latest occurrence before pos is the one they had
        v = link[cur]
        for _ in range(RECENCY_WALK):
            if v <= 0:
                break
            if self.end[v] != pos:
                self.prev_end[v], self.end[v] = self.end[v], pos
            v = link[v]

    def earlier_match(self) -> tuple[int, int]:
        """(length, end) of the longest suffix of the text that also ends
        earlier, and the end position of an earlier occurrence of it: the latest
        one, unless its class was last seen further up than ``RECENCY_WALK``
        classes; (0, -1) when even the last token is new."""
        v = self.link[self.last]
        if v <= 0:
            return 0, -1
        end = self.prev_end[v] if self.end[v] == len(self.tokens) - 1 else self.end[v]
        return (self.length[v], end) if end >= 0 else (0, -1)

    def walk(self, state: int, matched: int, t: int) -> tuple[int, int]:
        """Matching statistics: from (state, matched), the longest suffix of a
        pattern that occurs in this text, one pattern token on."""
        nxt, link, length = self.next, self.link, self.length
        while state > 0 and t not in nxt[state]:
            state = link[state]
            matched = length[state]
        if t in nxt[state]:
            return nxt[state][t], matched + 1
        return 0, 0


class ReplyMemory:
    """The replies of earlier requests, each after a separator no token equals
    (so no match spans two replies), up to ``budget`` tokens: past it, the
    older half is forgotten."""

    MATCH_WINDOW = 64  # a pattern this long is as good as any longer one

    def __init__(self, budget: int):
        self.budget = budget
        self.replies: list[list[int]] = []
        self.index = SuffixAutomaton()
        self.separator = -1
        self.state, self.matched = 0, 0

    def add(self, reply: Sequence[int]) -> None:
        if self.budget < 2 or not reply:
            return
        reply = list(reply)[-(self.budget - 1) :]  # and its separator
        self.replies.append(reply)
        if len(self.index) + len(reply) + 1 > self.budget:
            kept, total = [], 0
            for r in reversed(self.replies):
                if total + len(r) + 1 > self.budget // 2 and kept:
                    break
                kept.append(r)
                total += len(r) + 1
            self.replies = kept[::-1]
            self.index, self.separator = SuffixAutomaton(), -1
            for r in self.replies:
                self._append(r)
        else:
            self._append(reply)

    def _append(self, reply: list[int]) -> None:
        self.index.extend(reply)
        self.index.append(self.separator)
        self.separator -= 1

    def restart(self, context: Sequence[int]) -> None:
        self.state, self.matched = 0, 0
        self.follow(context[-self.MATCH_WINDOW :])

    def follow(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.state, self.matched = self.index.walk(self.state, self.matched, t)

    def continuation(self, k: int) -> list[int]:
        if self.matched == 0:
            return []
        at = self.index.end[self.state] + 1
        out = []
        for t in self.index.tokens[at : at + k]:
            if t < 0:
                break
            out.append(t)
        return out


class SuffixDrafter(Drafter):
    free_proposals = True

    def __init__(self, factor: float = 1.0, memory_tokens: int = 1 << 16, min_match: int = 3):
        self.factor = factor
        self.min_match = min_match
        self.memory = ReplyMemory(memory_tokens)
        self.index: Optional[SuffixAutomaton] = None
        self.pending = False  # a new request began: its prompt is read at its first drafting round
        self.replies: list[list[int]] = []  # replies not yet in the memory (added at the next drafting round)

    # ---- drafting

    def draft(self, k: int) -> list[int]:
        """Up to ``k`` tokens to follow the context read so far."""
        assert self.index is not None
        self.evidence = 0
        if k <= 0:
            return []
        length, end = self.index.earlier_match()
        if max(length, self.memory.matched) < self.min_match:
            return []
        if self.memory.matched > length:
            drafts = self.memory.continuation(self._budget(self.memory.matched, k))
            if drafts or length < self.min_match:
                self.evidence = self.memory.matched if drafts else 0
                return drafts
        at = end + 1
        drafts = self.index.tokens[at : at + self._budget(length, k)]
        self.evidence = length if drafts else 0
        return drafts

    def _budget(self, match: int, k: int) -> int:
        return max(1, min(k, int(match * self.factor)))

    # ---- the engine's Drafter interface

    def begin(self, request_id: str, prompt: Sequence[int], sampler, prefill: bool = True) -> None:
        self.pending = True  # read at the first round that drafts, never before the first token

    def sync(self, context: Sequence[int]) -> None:
        self._catch_up(context)

    def propose(self, context: Sequence[int], k: int, p_min: float):
        self._catch_up(context)
        drafts = self.draft(k)
        return drafts, [SparseDist.one_hot(d) for d in drafts]

    def finished(self, context: Sequence[int], prompt_tokens: int) -> None:
        """Remember the reply. It goes into the memory, and the index is brought up
        to date, at the next request's first drafting round (not here, before this
        request's ``done``)."""
        self.replies.append(list(context[prompt_tokens:]))

    def forget(self) -> None:
        self.memory = ReplyMemory(self.memory.budget)
        self.replies = []
        self.index = None

    def _catch_up(self, context: Sequence[int]) -> None:
        index = self.index
        n = len(index) if index is not None else 0
        if (
            index is None
            or len(context) < n
            or (n and context[n - 1] != index.tokens[-1])
            # a new request: keep the index only if its prompt extends the context read before
            or (self.pending and list(context[:n]) != index.tokens)
        ):
            self.index = index = SuffixAutomaton()
            n = 0
        self.pending = False
        new = context[n:]
        index.extend(new)
        moved = bool(self.replies)
        for reply in self.replies:
            self.memory.add(reply)
        self.replies = []
        if n == 0 or len(new) >= ReplyMemory.MATCH_WINDOW or moved:  # (the memory's states changed)
            self.memory.restart(context)
        else:
            self.memory.follow(new)
