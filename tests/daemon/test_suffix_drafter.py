"""The suffix drafter (daemon/drafting/suffix.py): its automaton against brute force,
what it drafts, its memory of earlier replies, and its index across requests."""

from __future__ import annotations

import itertools
import random

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tandem.daemon.drafting.suffix import RECENCY_WALK, ReplyMemory, SuffixAutomaton, SuffixDrafter
from tandem.daemon.worker.engine import Engine
from tandem.protocol import Generate


def latest_earlier_match(tokens: list[int]) -> tuple[int, int]:
    """Brute force: the longest suffix that also ends earlier, and its latest earlier end."""
    n = len(tokens)
    for length in range(n - 1, 0, -1):
        suffix = tokens[n - length :]
        for end in range(n - 2, length - 2, -1):
            if tokens[end - length + 1 : end + 1] == suffix:
                return length, end
    return 0, -1


def occurs(pattern: list[int], text: list[int]) -> bool:
    return any(text[i : i + len(pattern)] == pattern for i in range(len(text) - len(pattern) + 1))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=70))
def test_the_automaton_finds_the_longest_earlier_match_and_an_occurrence_of_it(tokens):
    sa = SuffixAutomaton()
    for i, t in enumerate(tokens):
        sa.append(t)
        text = tokens[: i + 1]
        length, end = sa.earlier_match()
        assert length == latest_earlier_match(text)[0]
        if length:  # a real occurrence, ending before the text does
            assert end < i and text[end - length + 1 : end + 1] == text[i + 1 - length :]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=70))
def test_without_long_runs_of_one_token_the_occurrence_is_the_latest(tokens):
    """The recency walk covers RECENCY_WALK suffix classes; a run of equal tokens
    longer than that is the case it leaves (an older occurrence, still real)."""
    runs = [len(list(g)) for _, g in itertools.groupby(tokens)]
    assume(max(runs) < RECENCY_WALK // 2)
    sa = SuffixAutomaton()
    for i, t in enumerate(tokens):
        sa.append(t)
        assert sa.earlier_match() == latest_earlier_match(tokens[: i + 1])


def test_after_a_long_run_of_one_token_the_occurrence_is_still_a_real_one():
    tokens = [0] * 20 + [1, 0]
    length, end = SuffixAutomaton(tokens).earlier_match()
    assert length == 1 and tokens[end] == 0 and end < 21


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=40), st.lists(st.integers(0, 3), min_size=1, max_size=30))
def test_matching_statistics_give_the_longest_suffix_that_occurs_in_the_text(text, pattern):
    sa = SuffixAutomaton(text)
    state, matched = 0, 0
    for i, t in enumerate(pattern):
        state, matched = sa.walk(state, matched, t)
        longest = max(n for n in range(i + 2) if n == 0 or occurs(pattern[i + 1 - n : i + 1], text))
        assert matched == longest


def test_it_drafts_what_followed_the_longest_match_not_the_latest_short_one():
    d = SuffixDrafter(factor=4.0, min_match=1)
    # "5 1 2" occurs once, followed by 3 4; "1 2" occurs later too, followed by 9 9
    context = [5, 1, 2, 3, 4, 0, 1, 2, 9, 9, 7, 5, 1, 2]
    d.begin("r", context, None)
    assert d.propose(context, 4, 0.0)[0] == [3, 4, 0, 1]


def test_the_draft_is_as_long_as_the_match_times_factor_and_at_most_k():
    context = [1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2, 3]
    for factor, k, expected in ((1.0, 8, 3), (2.0, 8, 6), (1.0, 2, 2), (0.1, 8, 1)):
        d = SuffixDrafter(factor=factor, min_match=1)
        d.begin("r", context, None)
        drafts, dists = d.propose(context, k, 0.0)
        assert drafts == [4, 5, 6, 7, 8, 0][:expected]
        assert [int(q.ids[0]) for q in dists] == drafts and all(q.probs[0] == 1.0 for q in dists)


def test_nothing_is_drafted_without_a_match_or_below_the_minimum_match():
    d = SuffixDrafter(min_match=1)
    d.begin("r", [1, 2, 3], None)
    assert d.propose([1, 2, 3], 4, 0.0)[0] == []
    d = SuffixDrafter()  # by default a match of 3 tokens or more
    d.begin("r", [1, 2, 9, 1, 2], None)
    assert d.propose([1, 2, 9, 1, 2], 4, 0.0)[0] == []
    d.begin("r", [1, 2, 9, 1, 2, 9], None)
    assert d.propose([1, 2, 9, 1, 2, 9], 4, 0.0)[0] == [1, 2, 9]


def test_replies_of_earlier_requests_are_drafted_from_and_no_match_spans_two():
    d = SuffixDrafter(factor=4.0, min_match=1)
    d.begin("a", [10, 11], None)
    d.finished([10, 11, 1, 2, 3, 4], 2)
    d.begin("b", [20, 21], None)
    d.finished([20, 21, 5, 6, 7], 2)
    context = [30, 31, 1, 2]  # a new prompt: the reply "1 2 3 4" is in the memory only
    d.begin("c", context, None)
    assert d.propose(context, 8, 0.0)[0] == [3, 4]  # ends where that reply ended, not in "5 6 7"
    context = context + [3, 4]
    assert d.propose(context, 8, 0.0)[0] == []


def test_the_memory_keeps_within_its_budget_and_forgets_the_oldest_replies():
    rng = random.Random(7)
    memory = ReplyMemory(budget=200)
    for _ in range(60):
        memory.add([rng.randrange(50) for _ in range(rng.randrange(1, 40))])
        assert len(memory.index) <= 200
    last = [1000, 1001, 1002]
    memory.add(last)
    memory.restart([1000, 1001])
    assert memory.matched == 2 and memory.continuation(4) == [1002]
    memory.add(list(range(2000, 2300)))  # one reply longer than the budget: its end is kept
    assert len(memory.index) <= 200


def test_an_agents_next_turn_extends_the_index_and_a_new_prompt_replaces_it():
    d = SuffixDrafter(min_match=1)
    turn1 = list(range(100, 140))
    d.begin("a", turn1, None)
    d.propose(turn1, 4, 0.0)
    index = d.index
    reply = [7, 8, 9]
    d.finished(turn1 + reply, len(turn1))
    turn2 = turn1 + reply + [100, 101]
    d.begin("b", turn2, None)
    assert d.propose(turn2, 4, 0.0)[0] == [102, 103]
    assert d.index is index and index.tokens == turn2  # read only what turn 2 added
    other = [500, 501, 502]
    d.begin("c", other, None)
    d.propose(other, 4, 0.0)
    assert d.index is not index and d.index.tokens == other


def test_the_prompt_is_read_at_the_first_draft_not_at_begin():
    d = SuffixDrafter()
    d.begin("r", list(range(1000)), None)
    assert d.index is None


def test_suffix_drafter_in_the_engine_on_a_copying_task(scripted_model):
    text = b"abc def abc def abc def abc def"
    req = Generate(id="r", prompt="abc def ", temperature=0.0, draft_tokens=4)
    done = Engine(scripted_model(text), None, drafter=SuffixDrafter(), draft_tokens=4).run(
        req, lambda chunk: None, lambda: False
    )
    assert done.text == text.decode()
    assert done.draft.accepted > 0


def test_cache_false_requests_and_clears_leave_nothing_in_its_memory(scripted_model):
    drafter = SuffixDrafter(min_match=1)
    engine = Engine(scripted_model(b"abc def abc def"), None, drafter=drafter, draft_tokens=4)
    engine.run(Generate(id="a", prompt="xyz", temperature=0.0, cache=False), lambda c: None, lambda: False)
    assert drafter.replies == [] and len(drafter.memory.index) == 0
    engine.run(Generate(id="b", prompt="xyz", temperature=0.0), lambda c: None, lambda: False)
    assert drafter.replies  # kept, for the next request's first drafting round
    engine.forget_live()  # what a cache clear and a cache: false request do
    assert drafter.replies == [] and drafter.index is None and len(drafter.memory.index) == 0
