"""One restart policy for both workers: backoff, the death window, give-up, the hung deadline (pure logic)."""

from __future__ import annotations

from tandem.daemon.front.restart_policy import BACKOFF_SECONDS, RestartPolicy


def test_each_death_waits_longer_until_the_window_holds_max_deaths():
    given_up = []
    p = RestartPolicy(5, 600.0, 120.0, give_up=lambda reason, how: given_up.append((reason, how)))
    delays = [p.died(t) for t in (0.0, 10.0, 20.0, 30.0)]
    assert delays == list(BACKOFF_SECONDS[:4]) and p.restarts == 4
    assert p.died(40.0) is None and p.restart_due is None and p.restarts == 4  # the fifth within 10 minutes
    assert p.reason() == "died 5 times within 10 minutes"
    assert not given_up  # the caller runs the action, after answering what the worker was doing
    p.give_up(p.reason(), "died (exit code -9)")
    assert given_up == [("died 5 times within 10 minutes", "died (exit code -9)")]


def test_deaths_older_than_the_window_no_longer_count():
    p = RestartPolicy(3, 600.0, 120.0)
    assert p.died(0.0) == 1 and p.died(100.0) == 2
    assert p.died(650.0) == 2  # the first fell out of the window: this is the second in it
    assert p.died(690.0) is None  # 100, 650 and 690 fall within 600 s


def test_the_backoff_stops_growing_at_its_last_step():
    p = RestartPolicy(100, 1e9, 120.0)
    delays = [p.died(float(t)) for t in range(10)]
    assert delays[-1] == BACKOFF_SECONDS[-1] and delays == sorted(delays)


def test_a_restart_is_due_once_and_a_failed_start_is_retried_after_the_longest_backoff():
    p = RestartPolicy(5, 600.0, 120.0)
    p.died(0.0)
    assert not p.due(0.5) and p.due(1.0) and not p.due(1.5)
    p.start_failed(1.0)
    assert not p.due(30.9) and p.due(31.0)
    p.died(40.0)
    p.cancel()
    assert not p.due(1e6)


def test_forgiving_clears_the_count():
    p = RestartPolicy(2, 600.0, 120.0)
    p.died(0.0)
    p.forgive()  # a request finished in between
    assert p.died(1.0) == 1


def test_the_hung_deadline_and_the_cause_of_death():
    p = RestartPolicy(5, 600.0, 2.0)
    p.heard(10.0)
    assert not p.silent_too_long(12.0) and p.silent_too_long(12.1)
    assert p.cause(-9) == "died (exit code -9)"
    p.killed_as_hung("did not answer within 2 s (worker_timeout) and was killed")
    assert p.cause(-9) == "did not answer within 2 s (worker_timeout) and was killed"
    assert p.cause(1) == "died (exit code 1)"  # said once: the next death is its own
