"""The governor, without a model: scripted speeds drive every transition; then
the engine with a scripted model whose passes advance a fake clock."""

from __future__ import annotations

import json
import logging
import os
import time

import numpy as np
import pytest

from tandem.daemon.drafting.governor import (
    DRAFTING,
    MAX_DEBT,
    MEASURING,
    PLAIN,
    PROBING,
    READ_MIN_TOKENS,
    REFRESHING,
    Governor,
    GovernorBank,
    GovernorParams,
    MovingRate,
    evidence_bucket,
    state_file,
    task_key,
)
from tandem.daemon.worker.engine import Engine
from tandem.protocol import Generate


def rounds(g: Governor, clock, n: int, plain_tps: float, draft_tps: float, draft_tokens: int = 3):
    """Run n rounds at the given speeds; returns the phases the rounds ran in."""
    seen = []
    for _ in range(n):
        seen.append(g.phase)
        tokens = draft_tokens if g.drafting else 1
        g.start_round()
        clock.advance(tokens / (draft_tps if g.drafting else plain_tps))
        g.end_round(tokens)
    return seen


def test_moving_rate_is_the_mean_until_the_window_then_exponential():
    r = MovingRate(window=4)
    assert r.rate is None
    for tokens, seconds in [(1, 0.1), (3, 0.1), (2, 0.4)]:
        r.add(tokens, seconds)
    assert r.rate == pytest.approx(6 / 0.6)  # a ratio of sums, not a mean of ratios
    r.add(2, 0.0)
    r.add(10, 0.6)  # weight 1/4 from the fifth round on
    tokens = 8 / 4 + (10 - 8 / 4) / 4
    seconds = 0.6 / 4 + (0.6 - 0.6 / 4) / 4
    assert r.rate == pytest.approx(tokens / seconds)
    r.restart()
    assert r.rate == pytest.approx(tokens / seconds)  # reported until replaced
    r.add(1, 1.0)
    assert r.rate == pytest.approx(1.0)


def test_measures_plain_first_then_drafts_and_keeps_drafting_while_it_pays(clock):
    g = Governor(clock=clock)
    assert g.phase == MEASURING and not g.drafting
    seen = rounds(g, clock, 2 + 40, plain_tps=10, draft_tps=20)
    assert seen[:2] == [MEASURING, MEASURING]
    assert set(seen[2:]) == {DRAFTING}
    assert g.plain.rate == pytest.approx(10) and g.draft.rate == pytest.approx(20)
    assert (g.plain_rounds, g.draft_rounds) == (2, 40)


def test_turns_off_when_drafting_is_slower_and_probes_after_32_rounds(clock):
    g = Governor(clock=clock)
    seen = rounds(g, clock, 4, plain_tps=10, draft_tps=8)
    assert seen == [MEASURING, MEASURING, DRAFTING, DRAFTING]
    assert g.phase == PLAIN and g.countdown == 32 and g.interval == 32
    seen = rounds(g, clock, 32, plain_tps=10, draft_tps=8)
    assert set(seen) == {PLAIN}
    assert g.phase == PROBING and g.probes == 1
    assert g.info().rounds_until_probe == 0


def test_each_failed_probe_doubles_the_interval_up_to_512(clock):
    g = Governor(clock=clock)
    rounds(g, clock, 4 + 32, plain_tps=10, draft_tps=8)  # off, then to the first probe
    intervals = []
    for _ in range(6):
        assert g.phase == PROBING
        seen = rounds(g, clock, 2, plain_tps=10, draft_tps=8)
        assert seen == [PROBING, PROBING]
        assert g.phase == PLAIN
        intervals.append(g.interval)
        seen = rounds(g, clock, g.interval, plain_tps=10, draft_tps=8)
        assert set(seen) == {PLAIN}
    assert intervals == [64, 128, 256, 512, 512, 512]
    assert g.failed_probes == 6 and g.probes == 7


def test_a_successful_probe_turns_drafting_back_on_and_resets_the_interval(clock):
    g = Governor(clock=clock)
    rounds(g, clock, 4 + 32 + 2 + 64, plain_tps=10, draft_tps=8)  # off, a failed probe, second probe due
    assert g.phase == PROBING and g.interval == 64
    # the task changed: drafting now pays. The probe restarts the drafting average,
    # so the old, slow estimate does not outvote what the probe measures.
    rounds(g, clock, 2, plain_tps=10, draft_tps=15)
    assert g.phase == DRAFTING and g.interval == 32
    assert g.draft.rate == pytest.approx(15)


def test_refreshes_the_plain_estimate_every_64_drafting_rounds(clock):
    g = Governor(clock=clock)
    seen = rounds(g, clock, 2 + 64 + 2 + 64 + 2, plain_tps=10, draft_tps=20)
    assert seen[2:66] == [DRAFTING] * 64
    assert seen[66:68] == [REFRESHING] * 2
    assert seen[68:132] == [DRAFTING] * 64
    assert seen[132:] == [REFRESHING] * 2
    # a refresh that finds plain decoding faster now (say the context grew and the
    # drafter slowed down less than... or the machine's load changed) turns drafting off
    rounds(g, clock, 64, plain_tps=10, draft_tps=20)
    assert g.phase == REFRESHING
    rounds(g, clock, 2, plain_tps=30, draft_tps=20)
    assert g.phase == PLAIN and g.countdown == 32
    assert g.plain.rate == pytest.approx(30)  # the refresh replaced the old estimate


def test_threshold_is_1_02_times_plain(clock):
    g = Governor(clock=clock)
    rounds(g, clock, 2 + 10, plain_tps=10, draft_tps=10.3)
    assert g.phase == DRAFTING
    g = Governor(clock=clock)
    rounds(g, clock, 2 + 2, plain_tps=10, draft_tps=10.1)
    assert g.phase == PLAIN


def test_turning_off_from_drafting_does_not_double_the_interval(clock):
    g = Governor(clock=clock)
    rounds(g, clock, 2 + 10, plain_tps=10, draft_tps=20)
    assert g.phase == DRAFTING
    rounds(g, clock, 30, plain_tps=10, draft_tps=5)  # the moving average sinks below plain
    assert g.phase == PLAIN and g.interval == 32 and g.failed_probes == 0


def test_a_costly_catch_up_delays_the_next_probe_until_plain_rounds_repay_it(clock):
    g = Governor(clock=clock)
    rounds(g, clock, 4 + 32, plain_tps=10, draft_tps=8)  # off; the first probe is due
    assert g.phase == PROBING
    g.caught_up(0.25)  # the drafter read a long context: 0.25 s = 1% of 25 s of plain decoding
    rounds(g, clock, 2, plain_tps=10, draft_tps=8)
    assert g.phase == PLAIN and g.interval == 64 and g.debt == pytest.approx(25.0)
    seen = rounds(g, clock, 249, plain_tps=10, draft_tps=8)  # 0.1 s per plain round
    assert set(seen) == {PLAIN} and g.countdown == 0 and g.debt > 0
    rounds(g, clock, 1, plain_tps=10, draft_tps=8)
    assert g.phase == PROBING
    assert g.info().probe_debt_seconds == 0.0


def test_skipped_round_is_not_counted(clock):
    g = Governor(clock=clock)
    g.start_round()
    clock.advance(5.0)
    g.skip_round()
    assert g.plain.n == 0 and g.plain_rounds == 0 and g.phase == MEASURING


def test_state_round_trips_through_a_dict(clock):
    g = Governor(clock=clock)
    rounds(g, clock, 4 + 32 + 2 + 10, plain_tps=10, draft_tps=8)
    h = Governor.from_dict(json.loads(json.dumps(g.to_dict())), GovernorParams(), clock)
    assert h.to_dict() == g.to_dict() and h.info() == g.info()


# ---------------------------------------------------------------------------- the bank: tasks, files


def test_bank_keeps_one_governor_per_task_and_forgets_the_least_recent(clock):
    bank = GovernorBank("id", clock=clock, max_tasks=2)
    a, b = bank.get("a"), bank.get("b")
    assert a is not b and bank.get("a") is a
    bank.get("c")  # "b" is the least recently used
    assert set(bank.tasks) == {"a", "c"}
    assert bank.info().task == "c" and bank.info().tasks == 2


def test_bank_persists_and_restores(tmp_path, clock):
    path = state_file(tmp_path, "id")
    bank = GovernorBank("id", path, clock=clock)
    rounds(bank.get("t1"), clock, 4 + 5, plain_tps=10, draft_tps=8)
    rounds(bank.get("t2"), clock, 2 + 5, plain_tps=10, draft_tps=30)
    bank.save()
    again = GovernorBank("id", path, clock=clock)
    assert {k: g.to_dict() for k, g in again.tasks.items()} == {k: g.to_dict() for k, g in bank.tasks.items()}
    assert again.tasks["t1"].phase == PLAIN and again.tasks["t2"].phase == DRAFTING
    assert again.info() == bank.info()
    assert not list(tmp_path.glob(".governor-*"))  # no temporary files left behind


@pytest.mark.parametrize(
    "content",
    [
        "not json {",
        json.dumps([1, 2]),
        json.dumps({"version": 99, "identity": "id", "tasks": {}}),
        json.dumps({"version": 1, "identity": "id", "tasks": {"t": {"phase": "dancing"}}}),
        json.dumps({"version": 1, "identity": "id", "tasks": {"t": {**Governor().to_dict(), "interval": -5}}}),
        json.dumps({"version": 1, "identity": "id", "tasks": {"t": {**Governor().to_dict(), "plain": [1, "x", 2]}}}),
        json.dumps({"version": 1, "identity": "another model", "tasks": {"t": Governor().to_dict()}}),
    ],
    ids=["not-json", "a-list", "other-version", "bad-phase", "bad-interval", "bad-average", "foreign"],
)
def test_a_corrupt_or_foreign_state_file_is_ignored_with_a_warning(tmp_path, caplog, content):
    path = tmp_path / "governor.json"
    path.write_text(content)
    with caplog.at_level(logging.WARNING, logger="tandem.governor"):
        bank = GovernorBank("id", path)
    assert bank.tasks == {} and bank.info() is None
    assert "ignoring the governor state" in caplog.text
    bank.get("t")
    bank.save()  # and the next save replaces the bad file
    assert json.loads(path.read_text())["identity"] == "id"


def test_task_key_is_the_prompt_start():
    assert task_key(list(range(40))) == task_key(list(range(16)) + [99] * 10)
    assert task_key(list(range(40))) != task_key([1] + list(range(1, 40)))


# ---------------------------------------------------------------------------- through the engine


SCRIPT = (b"the quick brown fox jumps over the lazy dog. " * 6)[:240]


@pytest.fixture
def timed_model(scripted_model):
    class TimedModel(scripted_model):
        """Each pass advances the clock: 10 ms for one token, 25 ms for 5 (a
        compute-bound CPU: verifying is not free)."""

        def __init__(self, clock, script: bytes = SCRIPT):
            super().__init__(script, n_ctx=512)
            self.clock = clock
            self.widths: list[int] = []

        def decode(self, tokens, logits_for=(-1,), abort=None):
            if self.n_past:  # not the prefill
                self.widths.append(len(tokens))
                self.clock.advance(0.010 + 0.00375 * (len(tokens) - 1))
            return super().decode(tokens, logits_for, abort)

    return TimedModel


@pytest.fixture
def engine_run(timed_model):
    """``engine_run(clock, bank, drafter, **params)``: one request on a fresh TimedModel -> (Done, the model)."""

    def run(clock, bank, drafter, **params):
        model = timed_model(clock)
        params = {"prompt": "hi", "temperature": 0.0, "max_tokens": 200, **params}
        req = Generate(id="r", **params)
        engine = Engine(model, None, drafter=drafter, draft_tokens=4, clock=clock, governors=bank)
        return engine.run(req, lambda chunk: None, lambda: False), model

    return run


def test_engine_keeps_drafting_when_drafts_are_right(clock, engine_run, list_drafter):
    bank = GovernorBank("id", clock=clock)
    done, model = engine_run(clock, bank, list_drafter(SCRIPT, set()))
    assert done.text == SCRIPT[:200].decode()
    g = done.governor
    assert g.phase == DRAFTING and g.plain_rounds == 2
    assert g.draft_tokens_per_second > 1.02 * g.plain_tokens_per_second
    assert model.widths[:2] == [1, 1] and set(model.widths[2:-1]) == {5}
    assert done.draft.rounds == g.draft_rounds


def test_engine_stops_drafting_when_drafts_are_wrong_and_output_is_unchanged(clock, engine_run, list_drafter):
    bank = GovernorBank("id", clock=clock)
    done, model = engine_run(clock, bank, list_drafter(SCRIPT, set(range(1000))))
    assert done.text == SCRIPT[:200].decode()
    g = done.governor
    assert g.phase in (PLAIN, PROBING) and g.probes >= 1 and g.failed_probes >= 1
    # measured 2 plain, drafted 2, then plain rounds with periodic 2-round probes
    assert model.widths[:4] == [1, 1, 5, 5]
    # 2 drafting rounds to learn, then 2 per probe (fewer if the last probe is under way)
    assert sum(w > 1 for w in model.widths) == g.draft_rounds
    assert 2 * g.probes < g.draft_rounds <= 2 * (1 + g.probes)
    assert model.widths.count(1) in (g.plain_rounds, g.plain_rounds + 1)  # + the last round: no room to draft
    # the next request of the same task starts where this one left off: no drafting
    done2, model2 = engine_run(clock, bank, list_drafter(SCRIPT, set(range(1000))))
    assert model2.widths[0] == 1 and done2.governor.plain_rounds > g.plain_rounds


def test_engine_tasks_are_governed_separately(clock, engine_run, list_drafter):
    bank = GovernorBank("id", clock=clock)
    engine_run(clock, bank, list_drafter(SCRIPT, set(range(1000))), prompt="task A, whose drafts fail")
    done, model = engine_run(clock, bank, list_drafter(SCRIPT, set()), prompt="task B, whose drafts pay")
    assert done.governor.phase == DRAFTING and done.governor.tasks == 2
    done, model = engine_run(clock, bank, list_drafter(SCRIPT, set(range(1000))), prompt="task A, whose drafts fail")
    assert model.widths[0] == 1  # task A is still known to be plain


@pytest.mark.parametrize(
    "params, drafts_every_round",
    [
        (dict(draft="on"), True),
        (dict(temperature=0.7, seed=3), True),  # seeded sampling: equal requests, equal tokens
        (dict(draft="off"), False),
    ],
)
def test_requests_that_force_the_mode_bypass_the_governor(clock, engine_run, list_drafter, params, drafts_every_round):
    bank = GovernorBank("id", clock=clock)
    engine_run(clock, bank, list_drafter(SCRIPT, set(range(1000))))  # the governor learns: plain
    before = bank.info()
    assert before.phase in (PLAIN, PROBING)
    done, model = engine_run(clock, bank, list_drafter(SCRIPT, set(range(1000))), **params)
    assert done.governor is None and bank.info() == before
    if drafts_every_round:
        assert set(model.widths[:-4]) == {5}  # (shorter drafts near max_tokens)
    else:
        assert set(model.widths) == {1} and done.draft is None


def test_seeded_sampling_reproduces_whatever_the_governor_learned(clock, engine_run, timed_model, list_drafter):
    def sample(bank):
        model = timed_model(clock)
        req = Generate(id="r", prompt="hi", temperature=1.0, top_k=0, top_p=1.0, seed=11, max_tokens=60)
        drafter = list_drafter(SCRIPT, {2, 5, 9})
        done = Engine(model, None, drafter=drafter, draft_tokens=4, clock=clock, governors=bank).run(
            req, lambda c: None, lambda: False
        )
        return done.text

    fresh = sample(GovernorBank("id", clock=clock))
    learned = GovernorBank("id", clock=clock)
    engine_run(clock, learned, list_drafter(SCRIPT, set(range(1000))))
    assert sample(learned) == fresh


def test_no_governor_drafts_every_round(clock, engine_run, list_drafter):
    done, model = engine_run(clock, None, list_drafter(SCRIPT, set(range(1000))))
    assert done.governor is None and set(model.widths[:-4]) == {5}
    assert np.isclose(done.draft.acceptance_rate, 0.0)


@pytest.fixture
def recording_drafter(list_drafter):
    class RecordingDrafter(list_drafter):
        """Busy reading the prompt for the first ``busy`` rounds; records what the engine asks."""

        def __init__(self, continuation, wrong_at, busy: int = 0):
            super().__init__(continuation, wrong_at)
            self.busy = busy
            self.prefills: list[bool] = []
            self.synced: list[int] = []

        def begin(self, request_id, prompt, sampler, prefill=True):
            super().begin(request_id, prompt, sampler)
            self.prefills.append(prefill)

        def ready(self):
            if self.busy:
                self.busy -= 1
                return False
            return True

        def sync(self, context):
            self.synced.append(len(context))

    return RecordingDrafter


def test_rounds_while_the_drafter_reads_the_prompt_are_plain_and_untimed(clock, engine_run, recording_drafter):
    bank = GovernorBank("id", clock=clock)
    drafter = recording_drafter(SCRIPT, set(), busy=3)
    done, model = engine_run(clock, bank, drafter)
    assert drafter.prefills == [True]  # a new task: the drafter reads the prompt in parallel
    assert model.widths[:5] == [1, 1, 1, 1, 1] and model.widths[5] == 5  # 3 untimed + 2 measured, then drafting
    assert done.governor.plain_rounds == 2
    # caught up (untimed) before the first drafting round: prompt "hi" + 5 tokens, minus the pending one
    assert drafter.synced == [2 + 5]


def test_a_task_known_to_be_plain_does_not_make_the_drafter_read_the_prompt(
    clock, engine_run, list_drafter, recording_drafter
):
    bank = GovernorBank("id", clock=clock)
    engine_run(clock, bank, list_drafter(SCRIPT, set(range(1000))))
    assert bank.info().phase == PLAIN
    probes_before = bank.info().probes
    drafter = recording_drafter(SCRIPT, set(range(1000)))
    done, model = engine_run(clock, bank, drafter)
    assert drafter.prefills == [False]
    # each probe that falls due catches the drafter up first (the last may be due just as the request ends)
    probes = done.governor.probes - probes_before
    assert probes >= 1 and len(drafter.synced) in (probes, probes - 1)
    assert all(n > 2 for n in drafter.synced)


# ---------------------------------------------------------------------------- predicting from pass costs

from tandem.daemon.drafting.governor import PassCosts, measure_pass_costs, measure_read_cost  # noqa: E402

# the TimedModel's passes: 10 ms for one token, +3.75 ms per extra token
TIMED_COSTS = {w: 0.010 + 0.00375 * (w - 1) for w in range(1, 6)}


def test_pass_costs_interpolate_follow_the_machine_and_prefer_what_rounds_measured():
    c = PassCosts({1: 0.010, 5: 0.025}, drafter_prior=0.002)
    assert c.target(1) == 0.010 and c.target(3) == pytest.approx(0.0175)  # between two measured widths
    assert c.target(7) == pytest.approx(0.0325)  # past the last: the same slope
    c.observe_target(1, 0.020)  # the machine is twice as busy as at load
    assert c.target(1) == pytest.approx(0.020) and c.target(3) == pytest.approx(0.035)
    c.observe_target(3, 0.030)  # a width rounds measured: that, not the scaled load figure
    assert c.target(3) == pytest.approx(0.030)
    assert c.drafter() == 0.002
    c.observe_drafter(4, 0.012)
    assert c.drafter() == pytest.approx(0.003)
    with pytest.raises(ValueError):
        PassCosts({}, 0.0)


def test_the_predicted_speedup_is_tokens_per_round_over_the_rounds_cost():
    c = PassCosts(TIMED_COSTS, drafter_prior=0.001)
    # k = 2, alpha 0.8: 1 + 0.8 + 0.64 tokens in a 3-token pass (17.5 ms) + 2 drafter steps (2 ms)
    assert c.speedup(2, 0.8) == pytest.approx(2.44 * 0.010 / 0.0195)
    assert c.speedup(3, 0.0) == pytest.approx(0.010 / (0.0175 + 0.003 + 0.00375))
    # the best k grows with alpha, and nothing pays when drafts are never right
    ks = [c.best(a, 4)[0] for a in (0.3, 0.6, 0.9, 0.97)]
    assert ks == sorted(ks) and ks[-1] == 4
    assert c.best(0.1, 4)[1] < 1.0 < c.best(0.9, 4)[1]


def test_probes_are_spaced_so_that_a_failed_one_costs_at_most_the_budget():
    c = PassCosts(TIMED_COSTS, drafter_prior=0.001)
    n = c.probe_interval(probe_rounds=2, budget=0.01)
    assert n < c.probe_interval(probe_rounds=2, budget=0.01, k=4)  # dearer probes: rarer
    excess = 2 * (c.round_seconds(1) - c.target(1))  # two rounds of one draft, each yielding one token
    assert excess <= 0.01 * n * c.target(1) < excess + 0.01 * c.target(1)


def test_with_costs_a_new_task_predicted_not_to_pay_starts_plain_and_a_probe_decides_by_prediction(clock):
    costs = PassCosts(TIMED_COSTS, drafter_prior=0.004)
    bank = GovernorBank("id", clock=clock, costs=costs, k_max=4)
    g = bank.get("task")  # pooled alpha 0.5 with nothing learned: drafting does not pay on these costs
    assert g.predicted_speedup(4) < 1.0 and g.phase == PLAIN
    assert g.countdown == costs.probe_interval(1, 0.01, 4) > 32
    seen = rounds(g, clock, g.countdown, plain_tps=100, draft_tps=100)
    assert set(seen) == {PLAIN} and g.phase == PROBING and g.draft_length(4) == 4  # a probe drafts the most
    # the probe's rounds are slower than plain ones, but every draft held: predicted to pay at the best length
    g.observe(4, 4, 0.002, 0.025)
    rounds(g, clock, 1, plain_tps=100, draft_tps=80)  # a probe is one round
    assert g.phase == DRAFTING and g.probes == 1 and g.failed_probes == 0
    # a probe whose drafts all fail: plain again, the interval doubled
    fresh = PassCosts(TIMED_COSTS, drafter_prior=0.004)
    g2 = GovernorBank("id2", clock=clock, costs=fresh, k_max=4).get("other")
    assert g2.phase == PLAIN
    rounds(g2, clock, g2.countdown, plain_tps=100, draft_tps=100)
    g2.observe(4, 0, 0.002, 0.025)
    rounds(g2, clock, 1, plain_tps=100, draft_tps=200)  # (its measured speed is not what decides)
    assert g2.phase == PLAIN and g2.failed_probes == 1


def test_with_costs_a_task_whose_drafts_hold_drafts_at_the_predicted_best_length(clock):
    costs = PassCosts(TIMED_COSTS, drafter_prior=0.0005)
    bank = GovernorBank("id", clock=clock, costs=costs, k_max=4)
    old = bank.get("old")
    for _ in range(40):
        old.observe(4, 4, 0.002, 0.025)  # every draft of an earlier task accepted
    g = bank.get("new")
    assert g.alpha_prior > 0.9 and g.phase == MEASURING  # predicted to pay: measured first, as without costs
    rounds(g, clock, 2, plain_tps=100, draft_tps=100)
    assert g.phase == DRAFTING and g.draft_length(4) == costs.best(g.alpha, 4)[0] == 4
    for _ in range(30):
        g.observe(4, 0, 0.002, 0.025)  # now every first draft is wrong
    assert g.alpha < 0.3 and g.draft_length(4) < 4
    info = g.info("new", 2, 4)
    assert info.alpha == pytest.approx(g.alpha) and info.draft_length == g.draft_length(4)
    assert info.predicted_speedup == pytest.approx(costs.best(g.alpha, 4)[1])


def test_the_acceptance_counts_survive_the_state_file_and_an_old_file_still_loads(tmp_path, clock):
    g = Governor(clock=clock)
    g.observe(3, 2, 0.003, 0.02)
    d = g.to_dict()
    back = Governor.from_dict(json.loads(json.dumps(d)), GovernorParams(), clock)
    assert (back.accepted, back.rejected, back.alpha_prior) == (2.0, 1.0, 0.5)
    for key in ("accepted", "rejected", "alpha_prior"):
        del d[key]
    assert Governor.from_dict(d, GovernorParams(), clock).accepted == 0.0  # written before predictions
    with pytest.raises(ValueError):
        Governor.from_dict({**g.to_dict(), "alpha_prior": 2.0}, GovernorParams(), clock)


def test_the_engine_drafts_the_predicted_length_and_feeds_the_costs_what_rounds_took(clock, engine_run, list_drafter):
    costs = PassCosts(TIMED_COSTS, drafter_prior=0.0)
    bank = GovernorBank("id", clock=clock, costs=costs, k_max=4)
    drafter = list_drafter(SCRIPT, set())  # always right: alpha climbs, the best length is the longest
    done, model = engine_run(clock, bank, drafter)
    assert bank.info().phase == DRAFTING and done.draft.acceptance_rate == 1.0
    assert max(model.widths) == 5 and costs.shape[5].n > 0  # the 5-token pass, measured in rounds
    assert costs.target(5) == pytest.approx(TIMED_COSTS[5])  # the scripted clock's cost, learnt
    wrong = list_drafter(SCRIPT, set(range(1000)))
    done, model = engine_run(clock, bank, wrong)
    assert done.text == engine_run(clock, GovernorBank("x", clock=clock), None)[0].text  # output unchanged


def test_pass_costs_are_measured_on_the_model_and_leave_it_empty(clock, timed_model):
    model = timed_model(clock)
    model.tokenize = lambda text, add_special=True, parse_special=True: list(range(1, 200))
    costs = measure_pass_costs(model, [1, 3, 5])
    assert set(costs) == {1, 3, 5} and model.n_past == 0
    read = measure_read_cost(model, 64)  # what a prompt token costs to read, the way prompts are read
    assert read is not None and read > 0 and model.n_past == 0
    assert model.decoded[-1] == list(range(1, 65))  # one 64-token prompt
    model.n_ctx = 60
    assert measure_read_cost(model, 64) is None  # no room for it


def test_what_catching_up_costs_a_token_is_predicted_from_reading_a_prompt_then_learnt():
    c = PassCosts({1: 0.010, 2: 0.012}, drafter_prior=0.004, read=0.0025)
    # a prompt token costs the target a quarter of a one-token pass: so a drafter's read, a quarter step
    assert c.read_prior() == pytest.approx(0.004 * 0.0025 / 0.010)
    assert c.catch_up(100) == pytest.approx(100 * 0.001) and c.catch_up(0) == 0.0
    c.observe_catch_up(4, 0.050)  # a few tokens: mostly a round trip, not what reading costs
    assert c.catch_up(100) == pytest.approx(0.1)
    c.observe_catch_up(400, 0.8)
    assert c.catch_up(100) == pytest.approx(0.2)
    narrow = PassCosts(TIMED_COSTS, drafter_prior=0.004)  # no prompt read measured: the widest pass, 5 tokens
    assert narrow.read_prior() == pytest.approx(0.004 * (TIMED_COSTS[5] / 5) / TIMED_COSTS[1])


def plain_rounds(g: Governor, clock, n: int, behind, seconds: float = 0.01) -> list[str]:
    seen = []
    for _ in range(n):
        seen.append(g.phase)
        g.start_round()
        clock.advance(seconds)
        g.end_round(1, behind=behind)
    return seen


def test_a_probe_waits_until_plain_rounds_have_paid_in_advance_for_the_catch_up_it_needs(clock):
    costs = PassCosts(TIMED_COSTS, drafter_prior=0.004)  # a drafter read costs 2 ms a token
    g = GovernorBank("id", clock=clock, costs=costs, k_max=4).get("task")
    assert g.phase == PLAIN and costs.catch_up(40) == pytest.approx(0.08)
    lacking = [40]  # what the drafter would read to catch up
    seen = plain_rounds(g, clock, g.countdown, lambda: lacking[0])
    # the interval has run out, but catching up would cost 80 ms: 1% of 8 s of plain rounds first
    assert set(seen) == {PLAIN} and g.phase == PLAIN and g.countdown == 0
    assert g.charged == pytest.approx(0.08) and g.debt == pytest.approx(8.0)
    assert g.info().probe_debt_seconds == pytest.approx(8.0)
    seen = plain_rounds(g, clock, 799, lambda: lacking[0])
    assert set(seen) == {PLAIN} and g.phase == PLAIN and 0 < g.debt < 0.02
    lacking[0] = 50  # meanwhile it lacks more: the difference is charged too
    plain_rounds(g, clock, 1, lambda: lacking[0])
    assert g.phase == PLAIN and g.charged == pytest.approx(0.10) and g.debt == pytest.approx(2.0)
    plain_rounds(g, clock, 200, lambda: lacking[0])
    assert g.phase == PROBING and g.probes == 1
    g.caught_up(0.09, 50)  # within what was paid for: no debt
    assert g.debt == 0.0 and g.charged == 0.0 and costs.catch_up(100) == pytest.approx(0.18)  # (learnt)
    g.charged = 0.05
    g.caught_up(0.08, 40)  # beyond it: the excess is owed before the next probe
    assert g.debt == pytest.approx(3.0) and g.charged == 0.0
    # a forecast far beyond anything real is capped where a state file still loads it
    g.charged, g.debt = 0.0, 0.0
    g._catch_up_paid(lambda: 10**15)
    assert g.debt == MAX_DEBT and Governor.from_dict(g.to_dict(), g.params, clock).debt == MAX_DEBT
    g.caught_up(1e12, 0)
    assert g.debt == MAX_DEBT and g.charged == 0.0
    # what was paid in advance survives a restart; a state written before it still loads
    g.charged = 0.25
    back = Governor.from_dict(json.loads(json.dumps(g.to_dict())), g.params, clock)
    assert back.charged == 0.25
    old = {k: v for k, v in g.to_dict().items() if k != "charged"}
    assert Governor.from_dict(old, g.params, clock).charged == 0.0
    for bad in (-1.0, "0.1", True, 1e8):
        with pytest.raises(ValueError):
            Governor.from_dict({**g.to_dict(), "charged": bad}, g.params, clock)


def test_catching_the_drafter_up_for_probes_costs_at_most_the_catch_up_share_of_plain_time(
    clock, engine_run, list_drafter
):
    """A task predicted not to pay starts plain, and its drafter does not read the
    prompt. A probe then needs the drafter to read the prompt and everything decoded
    since: the governor has that paid for in advance by plain rounds, at 1% of their
    time, so the probes come where there is least to read. (Before, the first probe
    of such a task fell due after 310 rounds, mid-request, and its catch-up cost 7%
    of the plain time before it.)"""
    read = 0.002  # seconds of the fake clock per token the drafter reads: the prior predicts this

    class LaggingDrafter(list_drafter):
        """A drafter with a KV cache of its own: it holds what it read."""

        def __init__(self, *a):
            super().__init__(*a)
            self.held = 0
            self.reads: list[tuple[int, int]] = []  # (tokens decoded so far, tokens read)
            self.events: list[tuple] = []  # ("begin",), ("asked", context length), ("synced", context length)

        def begin(self, request_id, prompt, sampler, prefill=True):
            super().begin(request_id, prompt, sampler, prefill)
            self.held = len(prompt) if prefill else 0
            self.events.append(("begin",))

        def behind(self, context):
            self.events.append(("asked", len(context)))
            return len(context) - min(self.held, len(context))

        def sync(self, context):
            self.events.append(("synced", len(context)))
            n = len(context) - min(self.held, len(context))
            self.reads.append((len(context) - self.prompt_len, n))
            clock.advance(n * read)
            self.held = len(context)

        def propose(self, context, k, p_min):
            self.held = len(context)
            return super().propose(context, k, p_min)

    costs = PassCosts(TIMED_COSTS, drafter_prior=0.004)
    assert costs.catch_up(1) == pytest.approx(read)
    bank = GovernorBank("id", clock=clock, costs=costs, k_max=4)
    drafter = LaggingDrafter(SCRIPT, set(range(1000)))  # every draft wrong: probes fail
    for _ in range(50):
        done, _ = engine_run(clock, bank, drafter)
        assert done.text == SCRIPT[:200].decode()
    g = bank.info()
    assert g.phase == PLAIN and g.probes >= 2 and len(drafter.reads) == g.probes
    assert all(n > 0 for _, n in drafter.reads)  # each probe read the prompt and what was decoded before it
    # what a probe was priced on is what it then read: the context after the round that made it due (the
    # forecast two events before the catch-up; the one just before is the engine's own, at the catch-up)
    e = drafter.events
    priced = [(e[i - 2], e[i]) for i, ev in enumerate(e) if ev[0] == "synced" and e[i - 2][0] == "asked"]
    assert priced and all(asked[1] == synced[1] for asked, synced in priced), priced
    catching_up = sum(n for _, n in drafter.reads) * read
    assert catching_up <= GovernorParams().catch_up_share * g.plain_rounds * TIMED_COSTS[1] * (1 + 1e-9)
    assert costs.read_seen is not None and costs.catch_up(1) == pytest.approx(read)  # learnt what it predicted

    class StuckDrafter(LaggingDrafter):
        def sync(self, context):
            super().sync(context)
            return False  # it did not get there (timed out, cancelled)

    costs = PassCosts(TIMED_COSTS, drafter_prior=0.004)
    bank = GovernorBank("id", clock=clock, costs=costs, k_max=4)
    stuck = StuckDrafter(SCRIPT, set(range(1000)))
    for _ in range(40):
        engine_run(clock, bank, stuck)
    assert max(n for _, n in stuck.reads) >= READ_MIN_TOKENS  # a read it would have learnt from
    assert costs.read_seen is None  # its time was owed, but taught nothing about reading


def test_the_learnt_read_cost_survives_a_restart_and_a_damaged_one_is_dropped_alone(tmp_path, clock):
    path = tmp_path / "governor.json"
    costs = PassCosts(TIMED_COSTS, drafter_prior=0.004)
    bank = GovernorBank("id", path, clock=clock, costs=costs)
    bank.get("task")
    costs.observe_catch_up(400, 1.2)
    bank.save()
    fresh = PassCosts(TIMED_COSTS, drafter_prior=0.004)
    second = GovernorBank("id", path, clock=clock, costs=fresh)
    assert fresh.catch_up(100) == pytest.approx(0.3)  # not the prior's 0.2
    bank.costs = None  # a daemon that learnt nothing of it keeps what the file holds
    bank.save()
    assert json.loads(path.read_text())["read"] == [400.0, 1.2, 1]
    costs.observe_catch_up(400, 2.0)  # the first daemon learns more and saves it ...
    bank.costs = costs
    bank.save()
    second.save()  # ... and the second, which only loaded its figure at start, does not write that back over it
    assert json.loads(path.read_text())["read"] == [pytest.approx(400.0), pytest.approx(1.6), 2]
    doc = json.loads(path.read_text())
    for bad in ([1, 2], "x", [400, -1, 1], [400, 1.2, 1.5], [True, 1.0, 1]):
        path.write_text(json.dumps({**doc, "read": bad}))
        other = PassCosts(TIMED_COSTS, drafter_prior=0.004)
        restored = GovernorBank("id", path, clock=clock, costs=other)
        assert other.read_seen is None and list(restored.tasks) == ["task"]


# --------------------------------------------------------------------------- free proposals (prompt lookup)


@pytest.fixture
def free_drafter(list_drafter):
    """``free_drafter(script, wrong_at, match=8)``: a ListDrafter whose proposals cost
    nothing, each copied after a match of ``match`` tokens."""

    class FreeListDrafter(list_drafter):
        free_proposals = True

        def __init__(self, continuation: bytes, wrong_at: set[int], match: int = 8):
            super().__init__(continuation, wrong_at)
            self.match = match

        def propose(self, context, k, p_min):
            drafts, dists = super().propose(context, k, p_min)
            self.evidence = self.match if drafts else 0
            return drafts, dists

    return FreeListDrafter


DECAY = 1 - 1 / GovernorParams().alpha_window


def test_a_shadow_measures_what_verifying_a_proposal_would_have_accepted():
    g = Governor(costs=PassCosts(TIMED_COSTS, drafter_prior=0.0))
    g.gated_round([5, 6, 7, 8], match=8, drafted=0, accepted=0, tokens=[5], seconds=0.01)  # a plain round
    assert g.shadow == [[5, 6, 7, 8], evidence_bucket(8), 1] and g.gate == {}
    g.gated_round([9], match=2, drafted=0, accepted=0, tokens=[6], seconds=0.01)  # one shadow at a time
    g.gated_round([], match=0, drafted=0, accepted=0, tokens=[7, 0], seconds=0.02)  # 8 expected, 0 came
    assert g.shadow is None and g.gate == {evidence_bucket(8): [3.0, 1.0]}
    assert g.gate_alpha(evidence_bucket(8)) == pytest.approx((3 + 0.5) / (4 + 1))
    assert g.gate_alpha(evidence_bucket(64)) == 0.5  # evidence never seen: the prior
    assert [evidence_bucket(m) for m in (0, 1, 2, 3, 4, 7, 8, 63, 64, 10**6)] == [1, 1, 2, 2, 3, 3, 4, 6, 7, 7]
    g.gated_round([1, 2, 3], match=8, drafted=0, accepted=0, tokens=[1], seconds=0.01)
    g.gated_round([], match=0, drafted=0, accepted=0, tokens=[2], seconds=0.01)
    g.new_request()  # the request ended with the shadow still holding: 2 matched, none rejected
    assert g.shadow is None and g.gate == {evidence_bucket(8): [pytest.approx(3 * DECAY + 2), pytest.approx(DECAY)]}
    restored = Governor.from_dict(json.loads(json.dumps(g.to_dict())), g.params, g.clock)
    assert restored.gate == g.gate
    for bad in ({"8": [1, 2]}, {"4": [1]}, {"4": [-1, 0]}, {"x": [0, 0]}):
        with pytest.raises(ValueError):
            Governor.from_dict({**g.to_dict(), "gate": bad}, g.params, g.clock)


def test_free_proposals_that_hold_are_drafted_from_the_first_request(clock, engine_run, free_drafter):
    costs = PassCosts(TIMED_COSTS, drafter_prior=0.0)
    bank = GovernorBank("id", clock=clock, costs=costs, k_max=4)
    done, model = engine_run(clock, bank, free_drafter(SCRIPT, set()))
    assert done.text == SCRIPT[:200].decode()
    assert model.widths[0] > 1 and max(model.widths) == 5  # drafted at once (verifying is cheap here)
    assert done.draft.acceptance_rate == 1.0 and done.draft.rounds >= 200 // 5 - 1
    assert done.governor.phase == DRAFTING and done.governor.probes == 0  # nothing to probe


def test_free_proposals_that_fail_cost_one_round_and_the_output_is_unchanged(clock, engine_run, free_drafter):
    costs = PassCosts(TIMED_COSTS, drafter_prior=0.0)
    bank = GovernorBank("id", clock=clock, costs=costs, k_max=4)
    done, model = engine_run(clock, bank, free_drafter(SCRIPT, set(range(1000))))
    assert done.text == SCRIPT[:200].decode()
    assert sum(w > 1 for w in model.widths) == 1 == done.draft.rounds  # the prior's one try, then shadows
    g = bank.get(bank.last_task)
    assert g.gate_alpha(evidence_bucket(8)) < 0.05
    done, model = engine_run(clock, bank, free_drafter(SCRIPT, set(range(1000))))
    assert set(model.widths) == {1} and done.draft is None  # the next request knows


def test_where_verifying_is_dear_lookup_drafts_wait_for_a_shadow_that_holds(clock, engine_run, free_drafter):
    dear = {w: 0.010 + 0.006 * (w - 1) for w in range(1, 6)}  # a 5-token pass costs 3.4 one-token ones
    costs = PassCosts(dear, drafter_prior=0.0)
    bank = GovernorBank("id", clock=clock, costs=costs, k_max=4)
    done, model = engine_run(clock, bank, free_drafter(SCRIPT, set()))
    assert done.text == SCRIPT[:200].decode()
    assert model.widths[:4] == [1, 1, 1, 1]  # the prior (0.5) does not pay: a shadow of 4 drafts first
    assert model.widths[4] > 1 and done.draft.acceptance_rate == 1.0


@pytest.mark.parametrize("alpha", [0.5, 0.8, 0.95])
def test_shadows_estimate_the_acceptance_without_bias(alpha):
    """Per-token acceptance alpha, 4-token proposals from one copy source every round
    (as prompt lookup makes them): a shadow that ends at a round's token must not be
    followed by one from that round's proposal (it would count the outcome twice)."""
    rng = np.random.default_rng(7)
    params = GovernorParams(alpha_window=10**9)  # no decay: the plain count
    g = Governor(params=params, costs=PassCosts(TIMED_COSTS, drafter_prior=0.0))
    for _ in range(40_000):
        # the copy's next 4 tokens: each holds with probability alpha, after the ones before
        proposal = [1, 1, 1, 1]
        token = 1 if rng.random() < alpha else 2
        g.gated_round(proposal, match=8, drafted=0, accepted=0, tokens=[token], seconds=0.01)
    a, r = g.gate[evidence_bucket(8)]
    assert a / (a + r) == pytest.approx(alpha, abs=0.01)


def test_evidence_buckets_are_learnt_apart_within_one_task(clock, engine_run, free_drafter):
    dear = {w: 0.010 + 0.006 * (w - 1) for w in range(1, 6)}
    bank = GovernorBank("id", clock=clock, costs=PassCosts(dear, drafter_prior=0.0), k_max=4)
    engine_run(clock, bank, free_drafter(SCRIPT, set(), match=8))  # long matches hold
    g = bank.get(bank.last_task)
    assert g.gate_alpha(evidence_bucket(8)) > 0.9
    done, model = engine_run(clock, bank, free_drafter(SCRIPT, set(), match=1))  # the same task, 1-token matches
    assert model.widths[:4] == [1, 1, 1, 1]  # not seen yet: a shadow first, whatever long matches did
    assert done.draft is not None and done.draft.rounds > 0


def test_the_engine_ends_a_shadow_with_its_request(clock, engine_run, free_drafter):
    bank = GovernorBank("id", clock=clock, costs=PassCosts(TIMED_COSTS, drafter_prior=0.0), k_max=4)
    engine_run(clock, bank, free_drafter(SCRIPT, set()))
    g = bank.get(bank.last_task)
    g.shadow = [[7, 7, 7], evidence_bucket(64), 2]  # as a request that ended by its stop sequence leaves one
    engine_run(clock, bank, free_drafter(SCRIPT, set()))  # the same task
    assert g.gate[evidence_bucket(64)] == [2.0, 0.0]  # counted when the next request began, never followed into it


def test_status_reports_the_gate_by_match_length_and_nothing_for_a_model_drafter(clock):
    g = Governor(params=GovernorParams(alpha_window=10**9), costs=PassCosts(TIMED_COSTS, drafter_prior=0.0))
    assert g.info().gate == {}  # a model drafter's governor probes: no gate
    for _ in range(50):
        g.gated_round([1, 1, 1, 1], match=5, drafted=4, accepted=4, tokens=[1, 1, 1, 1, 1], seconds=0.01)
        g.gated_round([1, 1], match=1, drafted=2, accepted=0, tokens=[2], seconds=0.01)
    gate = g.info().gate
    assert list(gate) == ["1", "4-7"]
    assert gate["4-7"] > 0.9 and gate["1"] < 0.1
    assert gate["4-7"] == round(g.gate_alpha(evidence_bucket(5)), 3)


@pytest.fixture
def remembering(timed_model):
    """A TimedModel that keeps the tokens its KV cache holds (``history``, as
    LlamaModel does) and runs every pass ``slow`` times slower (another process
    busy on the machine; ``slow_after``: from that pass of the next ones on)."""

    class Remembering(timed_model):
        def __init__(self, clock):
            super().__init__(clock)
            self.history: list[int] = []
            self.slow, self.slow_after = 1.0, None

        def decode(self, tokens, logits_for=(-1,), abort=None):
            before = self.clock.now
            out = super().decode(tokens, logits_for, abort)
            if self.slow_after is not None:
                self.slow_after -= 1
            if self.slow_after is None or self.slow_after < 0:
                self.clock.advance((self.clock.now - before) * (self.slow - 1))
            self.history.extend(tokens)
            return out

        def truncate(self, n_keep):
            super().truncate(n_keep)
            del self.history[n_keep:]

        def clear(self):
            super().clear()
            self.history = []

    return Remembering


def test_idle_time_re_measures_the_passes_a_governor_that_never_drafts_would_never_run(clock, remembering):
    """A load-time measurement that put wide passes at 3x what they cost keeps a
    lookup governor from ever verifying, so no round measures them again; idle
    time does, at the end of what the model holds, and leaves that as it was."""
    from tandem.daemon.worker.pass_timing import REFRESH_SECONDS

    Remembering = remembering
    inflated = {w: cost * (1 if w == 1 else 3) for w, cost in TIMED_COSTS.items()}
    costs = PassCosts(inflated, drafter_prior=2e-5)
    bank = GovernorBank("x", clock=clock, costs=costs, k_max=4)
    governor = bank.get("edit", 4)
    for _ in range(20):  # proposals after 5-token matches were always right
        governor._gate_add(evidence_bucket(5), 4, 4)
    assert governor.gated_length(4, 5) == 0  # predicted not to pay at the inflated costs
    model = Remembering(clock)
    model.decode(list(range(1, 41)))  # what the last request left in the KV cache
    kept = list(model.history)
    engine = Engine(model, None, drafter=None, clock=clock, governors=bank)
    assert engine.refresh_pass_costs(lambda: True) == 0  # a message is waiting: nothing measured
    assert model.widths == []  # (not even a warm-up pass)
    assert engine.refresh_pass_costs(lambda: False) == 4  # widths 2 ... 5
    assert model.n_past == 40 and model.history == kept  # the KV cache as it was
    for w in range(2, 6):
        assert costs.target(w) == pytest.approx(TIMED_COSTS[w])
    assert governor.gated_length(4, 5) > 0  # now it verifies
    assert engine.refresh_pass_costs(lambda: False) == 0  # not again before REFRESH_SECONDS
    clock.advance(REFRESH_SECONDS)
    asked = iter([False, False, True])  # a request comes after the warm-up passes, before the first width
    assert engine.refresh_pass_costs(lambda: next(asked)) == 0
    assert model.n_past == 40 and model.history == kept
    assert engine.refresh_pass_costs(lambda: False) == 4  # so the next idle time measures, not 30 s later
    no_costs = Engine(Remembering(clock), None, drafter=None, clock=clock, governors=GovernorBank("y", clock=clock))
    assert no_costs.refresh_pass_costs(lambda: False) == 0  # no pass costs: nothing to keep current
    clock.advance(REFRESH_SECONDS)
    passes = len(model.widths)
    assert engine.refresh_pass_costs(lambda: False, busy=lambda: True) == 0  # others keep the machine busy
    assert len(model.widths) == passes  # nothing run
    assert engine.refresh_pass_costs(lambda: False, busy=lambda: False) == 4  # the next idle time measures


def test_the_machine_is_busy_while_other_processes_compute():
    """machine_busy samples the time of the cores this process may run on: a
    process spinning on each makes it busy (whether an idle machine reads as not
    busy depends on what else runs here, so only this side is asserted)."""
    import subprocess
    import sys

    from tandem.daemon.worker.target_worker import machine_busy

    cores = sorted(os.sched_getaffinity(0))
    spinners = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                f"import os; os.sched_setaffinity(0, {{{core}}}); print(flush=True)\nwhile True: pass",
            ],
            stdout=subprocess.PIPE,
        )
        for core in cores
    ]
    try:
        for p in spinners:
            assert p.stdout.readline() == b"\n"  # spinning
        time.sleep(0.1)
        assert machine_busy()
    finally:
        for p in spinners:
            p.kill()
            p.wait(10)


def test_what_another_process_does_while_idle_time_re_measures_moves_no_width(clock, remembering):
    """Idle for the daemon is not idle for the machine: passes timed while
    another process is busy are all slower, and what idle time keeps is each
    width relative to the one-token passes beside it. A width timed while the
    machine changed is not counted."""
    from tandem.daemon.worker.pass_timing import REFRESH_SECONDS

    costs = PassCosts(TIMED_COSTS, drafter_prior=2e-5)
    bank = GovernorBank("x", clock=clock, costs=costs, k_max=4)
    model = remembering(clock)
    model.decode(list(range(1, 41)))
    engine = Engine(model, None, drafter=None, clock=clock, governors=bank)
    model.slow = 8.0  # (measured: a 2-token pass at 359 ms while another daemon served, 8 one-token passes)
    assert engine.refresh_pass_costs(lambda: False) == 4
    for w in range(1, 6):
        assert costs.target(w) == pytest.approx(TIMED_COSTS[w])  # not 8x: the level is the plain rounds'
    assert all(costs.shape[w].n == 1 for w in range(2, 6))
    clock.advance(REFRESH_SECONDS)
    model.slow, model.slow_after = 1 / 8, 4  # the other process stops right after the 2-token pass
    assert engine.refresh_pass_costs(lambda: False) == 3  # widths 3 ... 5; the 2-token pass's neighbours differ
    assert costs.shape[2].n == 1 and all(costs.shape[w].n == 2 for w in range(3, 6))
    for w in range(1, 6):
        assert costs.target(w) == pytest.approx(TIMED_COSTS[w])
    # nothing steady to count: not counted, and not tried again before REFRESH_SECONDS (no busy loop)
    narrow = PassCosts({1: 0.010, 2: 0.01375}, drafter_prior=2e-5)
    model = remembering(clock)
    model.decode(list(range(1, 41)))
    engine = Engine(model, None, drafter=None, clock=clock, governors=GovernorBank("y", clock=clock, costs=narrow))
    model.slow, model.slow_after = 4.0, 4
    assert engine.refresh_pass_costs(lambda: False) == 0 and narrow.shape == {}
    passes = len(model.widths)
    assert engine.refresh_pass_costs(lambda: False) == 0 and len(model.widths) == passes
    assert model.n_past == 40


def test_a_width_measured_in_a_round_is_kept_relative_to_the_plain_rounds_then():
    c = PassCosts(TIMED_COSTS, drafter_prior=0.0)
    c.observe_target(1, 0.020)  # plain rounds: the machine twice as busy as at load
    c.observe_target(5, 0.070)  # a 5-token round then: 3.5 one-token passes
    assert c.ratio(5) == pytest.approx(3.5) and c.target(5) == pytest.approx(0.070)
    for _ in range(40):
        c.observe_target(1, 0.010)  # quiet again: the 5-token pass is priced at the level now
    assert c.target(5) == pytest.approx(0.035, rel=0.02)  # (the level: a moving average)
    exact = PassCosts(TIMED_COSTS, drafter_prior=0.0, plain_width=2)  # exact steps: plain rounds read 2 tokens
    exact.observe_target(2, 2 * TIMED_COSTS[2])
    assert exact.level() == pytest.approx(2 * TIMED_COSTS[2]) and exact.target(5) == pytest.approx(2 * TIMED_COSTS[5])
    exact.observe_shape(5, 2.0)  # idle time: a 5-token pass at 2 plain (2-token) passes
    assert exact.ratio(2) == 1.0 and exact.target(5) == pytest.approx(2.0 * 2 * TIMED_COSTS[2])
    # a round's width is not learnt against a level no plain round measured lately
    fresh = PassCosts(TIMED_COSTS, drafter_prior=0.0)
    fresh.observe_target(5, 0.100)  # before any plain round: the load-time level is another context's
    assert 5 not in fresh.shape
    fresh.observe_target(1, 0.010)
    for _ in range(fresh.window):
        fresh.observe_target(5, 0.030)
    fresh.observe_target(5, 0.300)  # the 17th drafting round since the last plain one: not counted
    assert fresh.target(5) == pytest.approx(0.030)


@pytest.mark.parametrize("free", [False, True], ids=["model-drafter", "lookup-drafter"])
def test_what_a_round_costs_outside_its_pass_is_measured_and_paid_once_per_round(
    clock, timed_model, list_drafter, free_drafter, free
):
    """Streaming a round's tokens (and asking a lookup drafter) costs the same
    for a plain round as for one that yields five tokens: the prediction spreads
    it over a round's tokens, so drafting pays a little more than passes alone say."""
    costs = PassCosts(TIMED_COSTS, drafter_prior=0.0)
    bank = GovernorBank("id", clock=clock, costs=costs, k_max=4)
    drafter = free_drafter(SCRIPT, set()) if free else list_drafter(SCRIPT, set())
    engine = Engine(timed_model(clock), None, drafter=drafter, draft_tokens=4, clock=clock, governors=bank)
    req = Generate(id="r", prompt="hi", temperature=0.0, max_tokens=120, stream=True)
    done = engine.run(req, lambda chunk: clock.advance(0.004), lambda: False)  # each round's chunk: 4 ms
    assert done.text == SCRIPT[:120].decode()
    assert costs.outside() == pytest.approx(0.004)
    tokens = (1 - 0.9**5) / (1 - 0.9)
    assert costs.speedup(4, 0.9) == pytest.approx(tokens * (0.010 + 0.004) / (TIMED_COSTS[5] + 0.004))
    assert costs.speedup(4, 0.9) > PassCosts(TIMED_COSTS, drafter_prior=0.0).speedup(4, 0.9)
