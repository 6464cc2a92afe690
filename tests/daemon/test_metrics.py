"""The daemon's Prometheus metrics without a daemon: events from plain protocol messages move counters,
labels stay bounded, live gauges are read at scrape time, and the endpoint serves them on loopback."""

from __future__ import annotations

import logging
import urllib.error
import urllib.request

import prometheus_client
import pytest

from tandem.daemon.front.metrics import MAX_POSITIONS, REASONS, ROLES, TOKEN_BUCKETS, Metrics
from tandem.protocol import CacheInfo, Done, DraftStats, FinishReason, GovernorInfo, Timings, Usage


class Live:
    """A ``live`` callable whose snapshot a test can change; counts its calls."""

    def __init__(self, **overrides):
        self.snapshot = dict(queue_depth=3, active=1, ready=1, memory={"daemon": 1_000, "target": 2_000}, uptime=12.5)
        self.snapshot["pss"] = {"daemon": 600, "target": 1_500}
        self.snapshot.update(overrides)
        self.calls = 0

    def __call__(self) -> dict:
        self.calls += 1
        return self.snapshot


@pytest.fixture
def metrics():
    m = Metrics(Live())
    yield m
    m.close()


def value(m: Metrics, name: str, **labels) -> float | None:
    return m.registry.get_sample_value(name, labels)


def done(prompt=10, completion=5, cached=0, ttft=0.2, generation=0.4, draft=None, governor=None, cache=None) -> Done:
    return Done(
        id="r",
        text="x",
        finish_reason=FinishReason.STOP,
        usage=Usage(prompt, completion, cached),
        timings=Timings(ttft, 0.1, generation, 10.0, 0.0),
        draft=draft,
        governor=governor,
        cache=cache,
    )


def draft(rounds, drafted, accepted, per_position) -> DraftStats:
    return DraftStats(rounds=rounds, drafted=drafted, accepted=accepted, accepted_per_position=per_position)


def governor(drafting=True, plain=20.0, drafted=30.0) -> GovernorInfo:
    return GovernorInfo(
        task="t",
        tasks=1,
        phase="drafting" if drafting else "plain",
        drafting=drafting,
        plain_tokens_per_second=plain,
        draft_tokens_per_second=drafted,
        probe_interval=8,
        rounds_until_probe=0,
        probe_debt_seconds=0.0,
        plain_rounds=4,
        draft_rounds=4,
        probes=0,
        failed_probes=0,
    )


def cache(hits, misses, evictions, bytes_used=4096, budget=1 << 20, pages=2) -> CacheInfo:
    return CacheInfo(
        page_tokens=16,
        pages=pages,
        bytes_used=bytes_used,
        bytes_budget=budget,
        hits=hits,
        misses=misses,
        tokens_from_cache=0,
        tokens_prefilled=0,
        evictions=evictions,
    )


# --------------------------------------------------------------------------- a fresh registry


def test_a_fresh_registry_exports_every_reason_and_role_at_zero(metrics):
    for reason in REASONS:
        assert value(metrics, "tandem_requests_total", reason=reason) == 0
    for role in ROLES:
        assert value(metrics, "tandem_worker_restarts_total", role=role) == 0
    assert value(metrics, "tandem_generated_tokens_total") == 0
    assert value(metrics, "tandem_time_to_first_token_seconds_count") == 0


def test_every_metric_is_prefixed_tandem_and_has_help_text_and_no_created_series(metrics):
    families = list(metrics.registry.collect())
    assert len(families) > 20
    for family in families:
        assert family.name.startswith("tandem_"), family.name
        assert family.documentation, family.name
        assert not any(s.name.endswith("_created") for s in family.samples), family.name


def test_live_gauges_are_read_from_live_on_every_scrape():
    live = Live()
    m = Metrics(live)
    text = m.render().decode()
    assert "tandem_queue_depth 3.0" in text
    assert "tandem_active_requests 1.0" in text
    assert "tandem_ready 1.0" in text
    assert 'tandem_resident_memory_bytes{process="daemon"} 1000.0' in text
    assert 'tandem_resident_memory_bytes{process="target"} 2000.0' in text
    assert 'tandem_proportional_memory_bytes{process="target"} 1500.0' in text
    assert "tandem_uptime_seconds 12.5" in text
    calls = live.calls
    live.snapshot.update(queue_depth=0, active=0, ready=0, memory={"daemon": 7}, pss={}, uptime=99.0)
    assert value(m, "tandem_queue_depth") == 0 and value(m, "tandem_ready") == 0
    assert value(m, "tandem_resident_memory_bytes", process="daemon") == 7
    assert value(m, "tandem_resident_memory_bytes", process="target") is None  # gone from the snapshot, gone here
    assert value(m, "tandem_proportional_memory_bytes", process="target") is None
    assert value(m, "tandem_uptime_seconds") == 99.0
    assert live.calls > calls


def test_render_is_the_registrys_text_exposition(metrics):
    metrics.worker_restarted("target")
    assert metrics.render() == prometheus_client.generate_latest(metrics.registry)
    assert b'tandem_worker_restarts_total{role="target"} 1.0' in metrics.render()


# --------------------------------------------------------------------------- requests and tokens


def test_request_ended_counts_the_reason_and_the_done_tokens(metrics):
    metrics.request_ended("stop", done(prompt=10, completion=5, cached=4))
    metrics.request_ended("length", done(prompt=3, completion=2, cached=0))
    assert value(metrics, "tandem_requests_total", reason="stop") == 1
    assert value(metrics, "tandem_requests_total", reason="length") == 1
    assert value(metrics, "tandem_prompt_tokens_total") == 13
    assert value(metrics, "tandem_cached_prompt_tokens_total") == 4
    assert value(metrics, "tandem_generated_tokens_total") == 7


@pytest.mark.parametrize("reason", ["error", "busy", "cancelled"])
def test_request_ended_without_a_done_counts_only_the_reason(metrics, reason):
    metrics.request_ended(reason)
    assert value(metrics, "tandem_requests_total", reason=reason) == 1
    assert sum(value(metrics, "tandem_requests_total", reason=r) for r in REASONS) == 1
    assert value(metrics, "tandem_prompt_tokens_total") == 0
    assert value(metrics, "tandem_time_to_first_token_seconds_count") == 0


def test_an_unknown_reason_is_counted_as_error_so_labels_stay_bounded(metrics):
    metrics.request_ended("exploded")
    metrics.request_ended("")
    assert value(metrics, "tandem_requests_total", reason="error") == 2
    assert value(metrics, "tandem_requests_total", reason="exploded") is None
    assert b"exploded" not in metrics.render()


def test_time_to_first_token_is_observed_only_for_requests_that_generated(metrics):
    metrics.request_ended("stop", done(completion=3, ttft=0.3))
    metrics.request_ended("stop", done(completion=0, ttft=7.0))
    assert value(metrics, "tandem_time_to_first_token_seconds_count") == 1
    assert value(metrics, "tandem_time_to_first_token_seconds_sum") == pytest.approx(0.3)
    assert value(metrics, "tandem_time_to_first_token_seconds_bucket", le="0.25") == 0
    assert value(metrics, "tandem_time_to_first_token_seconds_bucket", le="0.5") == 1


def test_a_streamed_request_leaves_token_latency_to_tokens_relayed(metrics):
    metrics.request_ended("stop", done(completion=5, generation=0.4), streamed=True)
    assert value(metrics, "tandem_token_latency_seconds_count") == 0


def test_a_request_without_streaming_counts_its_mean_token_latency(metrics):
    metrics.request_ended("stop", done(completion=5, generation=0.4), streamed=False)
    assert value(metrics, "tandem_token_latency_seconds_count") == 4  # the tokens after the first
    assert value(metrics, "tandem_token_latency_seconds_sum") == pytest.approx(0.4)
    assert value(metrics, "tandem_token_latency_seconds_bucket", le="0.075") == 0
    assert value(metrics, "tandem_token_latency_seconds_bucket", le="0.1") == 4
    metrics.request_ended("stop", done(completion=1, generation=0.0), streamed=False)
    assert value(metrics, "tandem_token_latency_seconds_count") == 4  # one token: no gap to measure


def test_tokens_relayed_observes_each_token_at_the_chunks_mean_gap(metrics):
    metrics.tokens_relayed(3, 0.06)
    assert value(metrics, "tandem_token_latency_seconds_count") == 3
    assert value(metrics, "tandem_token_latency_seconds_sum") == pytest.approx(0.06)
    assert value(metrics, "tandem_token_latency_seconds_bucket", le="0.01") == 0
    assert value(metrics, "tandem_token_latency_seconds_bucket", le="0.02") == 3


def test_tokens_relayed_ignores_empty_chunks_and_clamps_a_negative_gap(metrics):
    metrics.tokens_relayed(0, 1.0)
    metrics.tokens_relayed(-2, 1.0)
    assert value(metrics, "tandem_token_latency_seconds_count") == 0
    metrics.tokens_relayed(2, -0.5)  # a clock step backwards
    assert value(metrics, "tandem_token_latency_seconds_sum") == 0
    assert value(metrics, "tandem_token_latency_seconds_bucket", le=str(TOKEN_BUCKETS[0])) == 2


# --------------------------------------------------------------------------- drafting


def test_draft_stats_add_up_and_acceptance_rate_is_cumulative(metrics):
    metrics.request_ended("stop", done(draft=draft(rounds=4, drafted=16, accepted=12, per_position=[4, 4, 3, 1])))
    assert value(metrics, "tandem_draft_acceptance_rate") == pytest.approx(12 / 16)
    metrics.request_ended("stop", done(draft=draft(rounds=2, drafted=4, accepted=0, per_position=[0, 0])))
    assert value(metrics, "tandem_draft_rounds_total") == 6
    assert value(metrics, "tandem_drafted_tokens_total") == 20
    assert value(metrics, "tandem_accepted_tokens_total") == 12
    assert value(metrics, "tandem_draft_acceptance_rate") == pytest.approx(12 / 20)  # not the last request's 0
    by_position = [value(metrics, "tandem_accepted_tokens_by_position_total", position=str(i)) for i in (1, 2, 3, 4)]
    assert by_position == [4, 4, 3, 1]


def test_draft_positions_start_at_one_skip_zeros_and_stop_at_the_limit(metrics):
    per_position = [0] * (MAX_POSITIONS + 4)
    per_position[1] = 2
    per_position[MAX_POSITIONS - 1] = 1
    per_position[MAX_POSITIONS] = 9  # beyond the bounded label set: not exported
    metrics.request_ended("stop", done(draft=draft(rounds=2, drafted=40, accepted=12, per_position=per_position)))
    assert value(metrics, "tandem_accepted_tokens_by_position_total", position="1") is None
    assert value(metrics, "tandem_accepted_tokens_by_position_total", position="2") == 2
    assert value(metrics, "tandem_accepted_tokens_by_position_total", position=str(MAX_POSITIONS)) == 1
    assert value(metrics, "tandem_accepted_tokens_by_position_total", position=str(MAX_POSITIONS + 1)) is None
    assert value(metrics, "tandem_accepted_tokens_by_position_total", position="0") is None


def test_a_request_with_no_draft_rounds_leaves_the_draft_metrics_alone(metrics):
    metrics.request_ended("stop", done(draft=DraftStats()))
    metrics.request_ended("stop", done(draft=None))
    assert value(metrics, "tandem_draft_rounds_total") == 0
    assert value(metrics, "tandem_draft_acceptance_rate") == 0
    assert b"tandem_accepted_tokens_by_position_total{" not in metrics.render()


# --------------------------------------------------------------------------- governor, cache, restarts


def test_governor_seen_sets_the_latest_tasks_state(metrics):
    metrics.governor_seen(governor(drafting=True, plain=20.0, drafted=31.5))
    assert value(metrics, "tandem_governor_drafting") == 1
    assert value(metrics, "tandem_governor_plain_tokens_per_second") == 20.0
    assert value(metrics, "tandem_governor_draft_tokens_per_second") == 31.5
    metrics.governor_seen(governor(drafting=False, plain=None, drafted=None))  # no measurement: keep the last
    assert value(metrics, "tandem_governor_drafting") == 0
    assert value(metrics, "tandem_governor_plain_tokens_per_second") == 20.0
    assert value(metrics, "tandem_governor_draft_tokens_per_second") == 31.5


def test_request_ended_passes_a_done_governor_and_cache_on(metrics):
    metrics.request_ended("stop", done(governor=governor(drafting=True, plain=5.0), cache=cache(1, 2, 0)))
    assert value(metrics, "tandem_governor_drafting") == 1
    assert value(metrics, "tandem_governor_plain_tokens_per_second") == 5.0
    assert value(metrics, "tandem_prefix_cache_hits_total") == 1
    assert value(metrics, "tandem_prefix_cache_misses_total") == 2


def test_cache_seen_turns_cumulative_counters_into_increments_and_sets_the_gauges(metrics):
    metrics.cache_seen(cache(hits=2, misses=1, evictions=0, bytes_used=8192, budget=1 << 20, pages=2))
    metrics.cache_seen(cache(hits=5, misses=1, evictions=3, bytes_used=4096, budget=1 << 20, pages=1))
    metrics.cache_seen(cache(hits=5, misses=1, evictions=3, bytes_used=4096, budget=1 << 20, pages=1))  # no news
    assert value(metrics, "tandem_prefix_cache_hits_total") == 5
    assert value(metrics, "tandem_prefix_cache_misses_total") == 1
    assert value(metrics, "tandem_prefix_cache_evictions_total") == 3
    assert value(metrics, "tandem_prefix_cache_bytes") == 4096
    assert value(metrics, "tandem_prefix_cache_budget_bytes") == 1 << 20
    assert value(metrics, "tandem_prefix_cache_pages") == 1


def test_the_disk_tier_has_its_own_counters_and_gauges(metrics):
    from dataclasses import replace

    from tandem.protocol import DiskCacheInfo

    def disk(hits, tokens, written, state="on"):
        return DiskCacheInfo(
            "/kv/ab", state, written, written * 1000, 1 << 30, hits, tokens, 0, 0.0, written, 0, 0.0, 0, 1
        )

    metrics.cache_seen(cache(hits=2, misses=1, evictions=0))  # before the tier reported anything
    metrics.cache_seen(replace(cache(hits=3, misses=1, evictions=0), disk=disk(1, 64, 4)))
    metrics.cache_seen(
        replace(cache(hits=4, misses=1, evictions=0), disk=disk(2, 128, 9, state="off: the disk is full"))
    )
    assert value(metrics, "tandem_prefix_cache_hits_total") == 4
    assert value(metrics, "tandem_prefix_cache_disk_hits_total") == 2
    assert value(metrics, "tandem_prefix_cache_disk_tokens_total") == 128
    assert value(metrics, "tandem_prefix_cache_disk_pages_written_total") == 9
    assert value(metrics, "tandem_prefix_cache_disk_dropped_total") == 1
    assert value(metrics, "tandem_prefix_cache_disk_pages") == 9
    assert value(metrics, "tandem_prefix_cache_disk_bytes") == 9000
    assert value(metrics, "tandem_prefix_cache_disk_budget_bytes") == 1 << 30
    assert value(metrics, "tandem_prefix_cache_disk_on") == 0


def test_cache_counters_of_a_restarted_worker_count_from_zero_again(metrics):
    metrics.cache_seen(cache(hits=10, misses=4, evictions=2))
    metrics.cache_seen(cache(hits=1, misses=0, evictions=2))  # a new worker: hits went down, so it restarted
    assert value(metrics, "tandem_prefix_cache_hits_total") == 11  # never decreases
    assert value(metrics, "tandem_prefix_cache_misses_total") == 4
    assert value(metrics, "tandem_prefix_cache_evictions_total") == 2
    metrics.cache_seen(cache(hits=3, misses=1, evictions=2))
    assert value(metrics, "tandem_prefix_cache_hits_total") == 13
    assert value(metrics, "tandem_prefix_cache_misses_total") == 5


def test_worker_restarted_counts_by_role(metrics):
    metrics.worker_restarted("target")
    metrics.worker_restarted("drafter")
    metrics.worker_restarted("drafter")
    assert value(metrics, "tandem_worker_restarts_total", role="target") == 1
    assert value(metrics, "tandem_worker_restarts_total", role="drafter") == 2


# --------------------------------------------------------------------------- the endpoint


def scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        return r.read().decode()


def test_serve_binds_a_free_loopback_port_and_serves_metrics_until_closed(caplog):
    live = Live(queue_depth=4)
    m = Metrics(live)
    try:
        with caplog.at_level(logging.WARNING, logger="tandem.daemon"):
            address = m.serve("127.0.0.1:0")
        assert not caplog.records  # loopback: no warning
        host, _, port = address.rpartition(":")
        assert host == "127.0.0.1" and int(port) > 0 and m.address == address
        m.request_ended("length", done(completion=2))
        text = scrape(address)
        assert 'tandem_requests_total{reason="length"} 1.0' in text
        assert "tandem_queue_depth 4.0" in text
        assert live.calls >= 1
    finally:
        m.close()
    m.close()  # twice is harmless
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://{address}/metrics", timeout=2)


def test_serve_on_ipv6_loopback_gives_a_bracketed_address():
    m = Metrics(Live())
    try:
        try:
            address = m.serve("[::1]:0")
        except OSError as exc:
            pytest.skip(f"no IPv6 loopback here: {exc}")
        assert address.startswith("[::1]:") and int(address.rpartition(":")[2]) > 0
        assert "tandem_uptime_seconds 12.5" in scrape(address)
    finally:
        m.close()
