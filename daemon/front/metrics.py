"""Every Prometheus metric of the daemon, in one place.

The front process owns them. The workers send plain numbers in the messages
they already send (``done``'s usage, timings, draft stats, governor and cache
info), and the front's main loop turns those into metrics here; gauges that
describe the present (queue depth, resident memory, state) are read when
Prometheus scrapes. Labels have fixed, small value sets: finish reason, worker
role, process, draft position (1-16).

The endpoint is prometheus_client's HTTP server on its own thread, bound to a
loopback address (see config.check for the rule on remote addresses).
"""

from __future__ import annotations

import logging
import socket
import socketserver
import threading
import wsgiref.simple_server
from typing import Callable, Optional

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from tandem.protocol import CacheInfo, Done, DraftStats, GovernorInfo

from ..config import is_loopback, is_loopback_host
from .tcp_owner import refusal

log = logging.getLogger("tandem.daemon")

prometheus_client.disable_created_metrics()  # no *_created series: they double the output and nobody reads them

REASONS = ("stop", "length", "cancelled", "error", "busy")
ROLES = ("target", "drafter", "embedding")
EMBED_OUTCOMES = ("done", "error", "busy")
MAX_POSITIONS = 16  # protocol.MAX_DRAFT_TOKENS

# 5 ms to 2 s, where per-token latencies of a CPU daemon fall; first tokens after a long prompt take longer
TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self, live: Callable[[], dict]):
        """``live()`` returns the present: ``queue_depth``, ``active``, ``ready``,
        ``memory`` ({process: rss bytes}), ``pss`` ({process: pss bytes}, may be
        absent); it is called on each scrape."""
        r = self.registry = CollectorRegistry(auto_describe=True)
        self._request_metrics(r)
        self._drafting_metrics(r)
        self._latency_metrics(r)
        self._cache_metrics(r)
        self._disk_metrics(r)
        self._worker_metrics(r)
        self._embedding_metrics(r)
        self._last_cache: Optional[tuple[int, ...]] = None
        self._draft_total = DraftStats()
        r.register(_Live(live))
        self.server = None
        self.address = ""

    # ------------------------------------------------------------------ the metrics, by concern

    def _request_metrics(self, r: CollectorRegistry) -> None:
        """Requests and their tokens."""
        self.requests = Counter(
            "tandem_requests", "Requests by how they ended (finish reason, error or busy)", ["reason"], registry=r
        )
        for reason in REASONS:
            self.requests.labels(reason)
        self.prompt_tokens = Counter("tandem_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_prompt_tokens = Counter(
            "tandem_cached_prompt_tokens",
            "Prompt tokens restored from the prefix cache instead of prefilled",
            registry=r,
        )
        self.generated_tokens = Counter("tandem_generated_tokens", "Tokens generated", registry=r)

    def _drafting_metrics(self, r: CollectorRegistry) -> None:
        """Speculative rounds, their drafts and the governor."""
        self.draft_rounds = Counter(
            "tandem_draft_rounds", "Speculative rounds: target passes that verified a draft", registry=r
        )
        self.drafted_tokens = Counter("tandem_drafted_tokens", "Draft tokens proposed", registry=r)
        self.accepted_tokens = Counter("tandem_accepted_tokens", "Draft tokens the target kept", registry=r)
        self.forced_tokens = Counter(
            "tandem_forced_tokens", "Tokens a response_format's grammar forced, read as free drafts", registry=r
        )
        self.accepted_by_position = Counter(
            "tandem_accepted_tokens_by_position",
            "Rounds whose draft token at this position (1 = first guess) was accepted",
            ["position"],
            registry=r,
        )
        self.acceptance_rate = Gauge(
            "tandem_draft_acceptance_rate", "Accepted / drafted tokens since start", registry=r
        )
        self.governor_drafting = Gauge(
            "tandem_governor_drafting",
            "1 while the governor drafts, 0 while it decodes plainly (latest task)",
            registry=r,
        )
        self.governor_plain = Gauge(
            "tandem_governor_plain_tokens_per_second",
            "The governor's moving average of plain decoding (latest task)",
            registry=r,
        )
        self.governor_draft = Gauge(
            "tandem_governor_draft_tokens_per_second",
            "The governor's moving average of drafting (latest task)",
            registry=r,
        )

    def _latency_metrics(self, r: CollectorRegistry) -> None:
        """Time to the first token, and per token after it."""
        self.ttft = Histogram(
            "tandem_time_to_first_token_seconds",
            "From the worker taking a request to its first token",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.token_latency = Histogram(
            "tandem_token_latency_seconds",
            "Time per generated token after the first, as the daemon relays them (a chunk's gap / its tokens; "
            "a request without streaming counts its mean)",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )

    def _cache_metrics(self, r: CollectorRegistry) -> None:
        """The prefix cache in shared memory."""
        self.cache_hits = Counter(
            "tandem_prefix_cache_hits", "Requests that restored at least one cached page", registry=r
        )
        self.cache_misses = Counter("tandem_prefix_cache_misses", "Requests that found no cached page", registry=r)
        self.cache_evictions = Counter(
            "tandem_prefix_cache_evictions", "Cached pages evicted to stay in budget", registry=r
        )
        self.cache_bytes = Gauge("tandem_prefix_cache_bytes", "Bytes of shared memory holding cached pages", registry=r)
        self.cache_budget = Gauge("tandem_prefix_cache_budget_bytes", "The prefix cache's byte budget", registry=r)
        self.cache_pages = Gauge("tandem_prefix_cache_pages", "Cached pages (of every model)", registry=r)

    def _disk_metrics(self, r: CollectorRegistry) -> None:
        """The disk tier (--disk-cache-bytes): the target's pages in files."""
        self.disk_hits = Counter(
            "tandem_prefix_cache_disk_hits", "Requests that read at least one page from the disk tier", registry=r
        )
        self.disk_tokens = Counter(
            "tandem_prefix_cache_disk_tokens",
            "Prompt tokens restored from the disk tier instead of prefilled",
            registry=r,
        )
        self.disk_pages_written = Counter(
            "tandem_prefix_cache_disk_pages_written", "Pages written to the disk tier (between requests)", registry=r
        )
        self.disk_evictions = Counter(
            "tandem_prefix_cache_disk_evictions", "Pages removed from the disk tier to stay in budget", registry=r
        )
        self.disk_dropped = Counter(
            "tandem_prefix_cache_disk_dropped",
            "Page files ignored: damaged, truncated, not this user's own, of another format",
            registry=r,
        )
        self.disk_bytes = Gauge("tandem_prefix_cache_disk_bytes", "Bytes of the disk tier's page files", registry=r)
        self.disk_budget = Gauge("tandem_prefix_cache_disk_budget_bytes", "The disk tier's byte budget", registry=r)
        self.disk_pages = Gauge("tandem_prefix_cache_disk_pages", "Pages in the disk tier", registry=r)
        self.disk_on = Gauge("tandem_prefix_cache_disk_on", "1 while the disk tier is on, 0 when it is off", registry=r)

    def _worker_metrics(self, r: CollectorRegistry) -> None:
        """The workers' restarts, and what a drafter's death did to requests."""
        self.restarts = Counter(
            "tandem_worker_restarts", "Worker processes restarted after they died", ["role"], registry=r
        )
        for role in ROLES:
            self.restarts.labels(role)
        self.preemptions = Counter(
            "tandem_preemptions",
            "Short requests served between two steps of a long one (the short-request lane, --preempt-tokens)",
            registry=r,
        )
        self.preempted_seconds = Counter(
            "tandem_preempted_seconds", "Time long requests waited for short ones the lane let in", registry=r
        )
        self.finished_without_drafter = Counter(
            "tandem_requests_finished_without_drafter",
            "Requests whose drafter worker died while they ran: they finished with plain decoding",
            registry=r,
        )

    def _embedding_metrics(self, r: CollectorRegistry) -> None:
        """Embed requests (the embedding model's worker), their inputs and tokens."""
        self.embed_requests = Counter(
            "tandem_embedding_requests",
            "Embed requests by how they ended (done, error or busy)",
            ["outcome"],
            registry=r,
        )
        for outcome in EMBED_OUTCOMES:
            self.embed_requests.labels(outcome)
        self.embed_inputs = Counter("tandem_embedding_inputs", "Inputs embedded (one vector each)", registry=r)
        self.embed_tokens = Counter("tandem_embedding_tokens", "Tokens the embedding model read", registry=r)

    # ------------------------------------------------------------------ events

    def embed_ended(self, outcome: str, inputs: int = 0, tokens: int = 0) -> None:
        self.embed_requests.labels(outcome if outcome in EMBED_OUTCOMES else "error").inc()
        self.embed_inputs.inc(inputs)
        self.embed_tokens.inc(tokens)

    def request_ended(self, reason: str, done: Optional[Done] = None, streamed: bool = True) -> None:
        """A terminal message. Per-token latency of a ``streamed`` request was observed
        chunk by chunk (tokens_relayed); one without chunks gets its mean from ``done``."""
        self.requests.labels(reason if reason in REASONS else "error").inc()
        if done is None:
            return
        self.prompt_tokens.inc(done.usage.prompt_tokens)
        self.cached_prompt_tokens.inc(done.usage.cached_tokens)
        self.generated_tokens.inc(done.usage.completion_tokens)
        if done.usage.completion_tokens > 0:
            self.ttft.observe(done.timings.time_to_first_token_seconds)
        if not streamed and done.usage.completion_tokens > 1:
            self.tokens_relayed(done.usage.completion_tokens - 1, done.timings.generation_seconds)
        if done.draft is not None and done.draft.forced:
            self.forced_tokens.inc(done.draft.forced)
        if done.draft is not None and done.draft.rounds:
            d = done.draft
            self.draft_rounds.inc(d.rounds)
            self.drafted_tokens.inc(d.drafted)
            self.accepted_tokens.inc(d.accepted)
            for i, n in enumerate(d.accepted_per_position[:MAX_POSITIONS]):
                if n:
                    self.accepted_by_position.labels(str(i + 1)).inc(n)
            self._draft_total.merge(d)
            if self._draft_total.acceptance_rate is not None:
                self.acceptance_rate.set(self._draft_total.acceptance_rate)
        if done.drafter_died:
            self.finished_without_drafter.inc()
        if done.governor is not None:
            self.governor_seen(done.governor)
        if done.cache is not None:
            self.cache_seen(done.cache)

    def preempted(self, seconds: float) -> None:
        """A short request was served within a long one (the lane), for ``seconds``."""
        self.preemptions.inc()
        self.preempted_seconds.inc(max(seconds, 0.0))

    def tokens_relayed(self, n: int, seconds: float) -> None:
        """``n`` tokens arrived ``seconds`` after the previous ones."""
        if n <= 0:
            return
        per = max(seconds, 0.0) / n
        for _ in range(n):
            self.token_latency.observe(per)

    def governor_seen(self, g: GovernorInfo) -> None:
        self.governor_drafting.set(1 if g.drafting else 0)
        if g.plain_tokens_per_second is not None:
            self.governor_plain.set(g.plain_tokens_per_second)
        if g.draft_tokens_per_second is not None:
            self.governor_draft.set(g.draft_tokens_per_second)

    def cache_seen(self, c: CacheInfo) -> None:
        """The worker's cumulative cache counters; a worker that restarted counts from 0 again."""
        d = c.disk
        counters = [self.cache_hits, self.cache_misses, self.cache_evictions]
        now = [c.hits, c.misses, c.evictions]
        if d is not None:
            counters += [
                self.disk_hits,
                self.disk_tokens,
                self.disk_pages_written,
                self.disk_evictions,
                self.disk_dropped,
            ]
            now += [d.hits, d.tokens_from_disk, d.pages_written, d.evictions, d.dropped]
        last = (*(self._last_cache or ())[: len(now)], *(0,) * len(now))
        for counter, new, old in zip(counters, now, last):
            counter.inc(new - old if new >= old else new)
        self._last_cache = tuple(now)
        self.cache_bytes.set(c.bytes_used)
        self.cache_budget.set(c.bytes_budget)
        self.cache_pages.set(c.pages)
        if d is not None:
            self.disk_bytes.set(d.bytes_used)
            self.disk_budget.set(d.bytes_budget)
            self.disk_pages.set(d.pages)
            self.disk_on.set(1 if d.state == "on" else 0)

    def worker_restarted(self, role: str) -> None:
        self.restarts.labels(role).inc()

    # ------------------------------------------------------------------ endpoint

    def serve(self, addr: str, other_users: bool = False) -> str:
        """Listen on ``addr`` (HOST:PORT; port 0 picks one); returns the address bound.
        On loopback only this user is served, unless ``other_users``."""
        host, _, port = addr.rpartition(":")
        host = host.strip("[]")
        loopback = is_loopback(addr)
        if not loopback:
            log.warning("metrics are served on %s, which is not loopback: other machines can read them", addr)
        app = prometheus_client.make_wsgi_app(self.registry)
        # on loopback, only a Host that names this machine exactly: a web page cannot reach it by DNS rebinding
        self.server = _serve_wsgi(host, int(port), _loopback_hosts_only(app, other_users) if loopback else app)
        bound = self.server.server_address[1]
        self.address = f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}"
        return self.address

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def render(self) -> bytes:
        return prometheus_client.generate_latest(self.registry)


def _loopback_hosts_only(app, other_users: bool = False):
    """Only this user (unless ``other_users``), and only a Host that names this machine
    (see tcp_owner and config.is_loopback_host)."""

    def checked(environ, start_response):
        why = None if other_users else refusal(environ["tandem.peer"], environ["tandem.local"])
        if why is None and not is_loopback_host(environ.get("HTTP_HOST", "")):
            why = "the Host header is not loopback: tandem's metrics answer only clients on this machine"
        if why is not None:
            start_response("403 Forbidden", [("Content-Type", "text/plain; charset=utf-8")])
            return [why.encode() + b"\n"]
        return app(environ, start_response)

    return checked


class _QuietHandler(wsgiref.simple_server.WSGIRequestHandler):
    timeout = 10  # a connection that sends nothing does not keep its thread

    def get_environ(self):
        environ = super().get_environ()
        environ["tandem.peer"] = self.client_address
        environ["tandem.local"] = self.connection.getsockname()
        return environ

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the base class's name
        pass


def _serve_wsgi(host: str, port: int, app):
    """``app`` on HOST:PORT in a thread of its own, one thread per connection (as
    prometheus_client.start_http_server serves, with the Host check in front)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    server_class = type(
        "_MetricsServer",
        (socketserver.ThreadingMixIn, wsgiref.simple_server.WSGIServer),
        {"daemon_threads": True, "address_family": family},
    )
    server = wsgiref.simple_server.make_server(host, port, app, server_class, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server


class _Live(Collector):
    """Gauges read at scrape time, from the main loop's last published snapshot."""

    def __init__(self, live: Callable[[], dict]):
        self.live = live

    def describe(self):
        return []

    def collect(self):
        s = self.live()
        yield GaugeMetricFamily("tandem_queue_depth", "Requests waiting in the queue", value=s["queue_depth"])
        yield GaugeMetricFamily("tandem_active_requests", "Requests being decoded (0 or 1)", value=s["active"])
        yield GaugeMetricFamily(
            "tandem_ready", "1 when the models are loaded and requests are served", value=s["ready"]
        )
        mem = GaugeMetricFamily("tandem_resident_memory_bytes", "Resident memory (RSS) by process", labels=["process"])
        for process, rss in s["memory"].items():
            mem.add_metric([process], rss)
        yield mem
        pss = GaugeMetricFamily(
            "tandem_proportional_memory_bytes",
            "Proportional memory (PSS) by process: a page mapped n times counts 1/n in each mapping",
            labels=["process"],
        )
        for process, size in s.get("pss", {}).items():
            pss.add_metric([process], size)
        yield pss
        yield GaugeMetricFamily("tandem_uptime_seconds", "Seconds since the daemon started", value=s["uptime"])
