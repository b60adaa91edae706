"""Prometheus metrics of one gateway instance (served at ``/metrics``).

Each gateway gets its own `CollectorRegistry`, so several instances can live in one process
(tests) without colliding in the global registry.

Several worker processes (``gateway.workers`` > 1, `ingest.prefork`): the supervisor sets
``PROMETHEUS_MULTIPROC_DIR`` to a fresh directory before it starts the workers, so every value is
kept in a file per process there, and ``/metrics``, whichever worker answers it, is the
`MultiProcessCollector`'s merge of all of them: counters and histograms summed over the workers
(a restarted worker's counts stay in), each gauge merged by its ``multiprocess_mode`` (in-flight
and spool bytes summed over the live workers, Kafka connected and servers in rotation the lowest
worker's, ages the highest). Gauges read from a function (`bind`) cannot be read across processes:
each worker writes them into its file every `REFRESH_EVERY_S` (`refresh`, from the lifespan) and
before it answers ``/metrics``. The process_* metrics of `ProcessCollector` are left out there (they
would be the answering worker's alone). One process (``workers = 1``): as before, one registry.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from schemas.settings.canary import LATENCY_BUCKETS_S

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
REFRESH_EVERY_S = 1.0


def multiprocess() -> bool:
    """True in a worker of a pre-forked gateway (the supervisor set ``PROMETHEUS_MULTIPROC_DIR``;
    prometheus_client reads it when it is imported, so it must be set before the worker starts)."""
    return bool(os.environ.get(MULTIPROC_ENV))


class GatewayMetrics:
    """Counters an operator alarms on: see docs/runbooks/gateway.md. The families are made in
    groups by what they watch; each is an attribute (``metrics.requests``, ``metrics.auth``, ...)."""

    requests: Counter
    auth: Counter
    body_refused: Counter
    keys_age: Gauge
    shed: Counter
    tenant_in_flight: Gauge
    tenants_at_cap: Gauge
    upstream_latency: Histogram
    upstream_requests: Counter
    in_flight: Gauge
    in_rotation: Gauge
    canary_live: Gauge
    canary_requests: Counter
    canary_arm_requests: Counter
    canary_latency: Histogram
    canary_flush: Counter
    upstream_connections: Gauge
    version_source: Counter
    version_mismatch: Counter
    straddled: Counter
    untrainable: Counter
    truncated: Counter
    redacted: Counter
    publish: Counter
    spool_bytes: Gauge
    spool_max_bytes: Gauge
    overflow_bytes: Gauge
    overflow_max_bytes: Gauge
    kafka_connected: Gauge
    oldest_in_flight: Gauge
    producer_replaced: Counter

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.multiprocess = multiprocess()
        self._bound: list[tuple[Gauge, Callable[[], float]]] = []
        if not self.multiprocess:
            ProcessCollector(
                registry=self.registry
            )  # process_cpu_seconds_total, memory, open fds, start time
        self._request_families()
        self._load_families()
        self._upstream_families()
        self._capture_families()
        self._publish_families()

    def bind(self, gauge: Gauge, read: Callable[[], float]) -> None:
        """Make `gauge` (a family without labels or one child) report `read()`: read at scrape time
        in one process (``set_function``); written by `refresh` in a worker of several."""
        if self.multiprocess:
            self._bound.append((gauge, read))
        else:
            gauge.set_function(read)

    def refresh(self) -> None:
        """Write the bound gauges' current values into this worker's file (multiprocess mode)."""
        for gauge, read in self._bound:
            gauge.set(read())

    def exposition(self) -> bytes:
        """The ``/metrics`` page: this registry, or in a worker of several every worker's merged."""
        if not self.multiprocess:
            return generate_latest(self.registry)
        self.refresh()
        merged = CollectorRegistry()
        MultiProcessCollector(merged)  # type: ignore[no-untyped-call]
        return generate_latest(merged)

    def _request_families(self) -> None:
        """Calls and who made them: answers by endpoint and status, authentication, bodies refused."""
        self.requests = Counter(
            "rtrl_gateway_requests_total",
            "Requests answered by the gateway, by endpoint and HTTP status.",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.auth = Counter(
            "rtrl_gateway_auth_total",
            "Calls by authentication outcome: ok, missing_key, invalid_key, wrong_role, rate_limited, "
            "keys_not_loaded, foreign_tenant, foreign_request.",
            ["outcome"],
            registry=self.registry,
        )
        self.body_refused = Counter(
            "rtrl_gateway_body_refused_total",
            "Requests refused unread because their body was over the route's limit (413), by path.",
            ["path"],
            registry=self.registry,
        )
        self.keys_age = Gauge(
            "rtrl_gateway_keys_age_seconds",
            "Seconds since the API keys in force were read from the store (it grows while the store is down).",
            multiprocess_mode="livemax",
            registry=self.registry,
        )

    def _load_families(self) -> None:
        """Load the gateway refused or cut short to stay up for everyone (docs/security.md); no
        tenant label, so a tenant count cannot grow the families."""
        self.shed = Counter(
            "rtrl_gateway_shed_total",
            "Requests refused or streams ended to protect the gateway, by reason: tenant_cap (429: the tenant "
            "had gateway.max_concurrent_per_tenant in flight), tenant_tokens (429: its requests in flight asked for "
            "gateway.max_inflight_tokens_per_tenant), feedback_rate (429: over gateway.feedback_events_per_s), "
            "upstream_connection (503: no connection to "
            "vLLM within gateway.upstream_acquire_timeout_s), slow_reader (a stream whose client took no "
            "chunk within gateway.stream_write_timeout_s, ended and captured truncated).",
            ["reason"],
            registry=self.registry,
        )
        self.tenant_in_flight = Gauge(
            "rtrl_gateway_tenant_requests_in_flight",
            "Completion requests and streams in flight at this gateway, all tenants together.",
            multiprocess_mode="livesum",
            registry=self.registry,
        )
        self.tenants_at_cap = Gauge(
            "rtrl_gateway_tenants_at_cap",
            "Tenants with gateway.max_concurrent_per_tenant requests in flight now (their next one is 429).",
            multiprocess_mode="livesum",
            registry=self.registry,
        )

    def _upstream_families(self) -> None:
        """The vLLM fleet behind the gateway: latency, requests and in-flight per server, rotation."""
        self.upstream_latency = Histogram(
            "rtrl_gateway_upstream_latency_seconds",
            "Latency of the vLLM call behind a request.",
            ["endpoint"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
            registry=self.registry,
        )
        self.upstream_requests = Counter(
            "rtrl_gateway_upstream_requests_total",
            "Requests the gateway sent to each vLLM server (a server out of rotation gets none).",
            ["server"],
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "rtrl_gateway_upstream_in_flight",
            "Requests this gateway has on each vLLM server now (streams until they end).",
            ["server"],
            multiprocess_mode="livesum",
            registry=self.registry,
        )
        self.upstream_connections = Gauge(
            "rtrl_gateway_upstream_connections",
            "Connections the gateway may hold to its vLLM servers (gateway.upstream_connections): "
            "sum(rtrl_gateway_upstream_in_flight) near it means requests are waiting for one.",
            multiprocess_mode="livesum",
            registry=self.registry,
        )
        self.in_rotation = Gauge(
            "rtrl_gateway_servers_in_rotation",
            "Serving vLLM servers the gateway routes to (the others are out of rotation for a swap).",
            multiprocess_mode="livemin",
            registry=self.registry,
        )
        self.canary_live = Gauge(
            "rtrl_gateway_canary_live",
            "1 while this gateway routes the live canary's share of users to the canary server, else 0.",
            multiprocess_mode="livemax",
            registry=self.registry,
        )
        self.canary_requests = Counter(
            "rtrl_gateway_canary_requests_total",
            "Requests of the live canary's share of users sent to the canary server.",
            registry=self.registry,
        )
        self._canary_traffic_families()

    def _canary_traffic_families(self) -> None:
        """What the live canary's guards read (ingest/canary_traffic.py), as this gateway counted it."""
        self.canary_arm_requests = Counter(
            "rtrl_gateway_canary_arm_requests_total",
            "Completion requests while a canary was live, by arm (canary: served by the canary server, fleet) "
            "and outcome (ok, error: answered with an upstream failure); the counts the canary's errors guard reads.",
            ["arm", "outcome"],
            registry=self.registry,
        )
        self.canary_latency = Histogram(
            "rtrl_gateway_canary_latency_seconds",
            "Latency from the handler's start to the last byte sent of completion requests while a canary was "
            "live, by arm; the buckets the canary's latency guard reads.",
            ["arm"],
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.canary_flush = Counter(
            "rtrl_gateway_canary_traffic_flush_total",
            "Flushes of this gateway's canary counts to the store that wrote rows, by outcome (ok, failed: "
            "the store was unreachable; the next flush carries the counts).",
            ["outcome"],
            registry=self.registry,
        )
        for arm in ("canary", "fleet"):
            for outcome in ("ok", "error"):
                self.canary_arm_requests.labels(arm, outcome)
        for outcome in ("ok", "failed"):
            self.canary_flush.labels(outcome)

    def count_canary(self, arm: str, error: bool, latency_s: float) -> None:
        """One request counted for a live canary (ingest/canary_traffic.py `CanaryCounts.record`)."""
        self.canary_arm_requests.labels(arm, "error" if error else "ok").inc()
        self.canary_latency.labels(arm).observe(latency_s)

    def _capture_families(self) -> None:
        """What the captured events record: how versions were established, straddles, untrainable and truncated generations, redactions."""
        self.version_source = Counter(
            "rtrl_gateway_version_source_total",
            "Generations by how their weight version was established: announced (by the deployer, "
            "no request to vLLM) or read (GET /weight_info before and after).",
            ["source"],
            registry=self.registry,
        )
        self.version_mismatch = Counter(
            "rtrl_gateway_version_mismatch_total",
            "Announced versions a server contradicted (or could not confirm): versions changed outside "
            "the deployer, or the server restarted.",
            ["server"],
            registry=self.registry,
        )
        self.straddled = Counter(
            "rtrl_gateway_straddled_total",
            "Requests whose generation straddled a weight swap (published with trainable=false).",
            registry=self.registry,
        )
        self.untrainable = Counter(
            "rtrl_gateway_untrainable_total",
            "Requests captured as not trainable because the trainer cannot reproduce how they were sampled, by "
            "reason (penalty, logit_bias, token_restriction, guided_decoding, min_tokens, logits_processors, "
            "beam_search; schemas/sampling.py).",
            ["reason"],
            registry=self.registry,
        )
        self.truncated = Counter(
            "rtrl_gateway_stream_truncated_total",
            "Streamed generations that ended early (client gone, upstream failure): published truncated, never trained.",
            registry=self.registry,
        )
        self.redacted = Counter(
            "rtrl_gateway_redacted_total",
            "Interaction events in which a redaction detector masked text, by detector.",
            ["kind"],
            registry=self.registry,
        )

    def _publish_families(self) -> None:
        """Getting events to Kafka: publish outcomes, the spool, the producer."""
        self.publish = Counter(
            "rtrl_gateway_publish_total",
            "Events by publish outcome: ok (acked by Kafka), spooled, replayed (acked from the spool), "
            "overflow (spool full, written to overflow.jsonl), undeliverable (too large for Kafka, written to "
            "overflow.jsonl), dead_letter (not a valid event, sent to the dead-letter topic), dropped (the overflow file "
            "was full too, or both publish queues; each is logged as DROPPED), lost (the disk refused both the spool and "
            "the overflow file; each is logged as LOST). A feedback event that ends in neither ok nor spooled is "
            "answered 503, not 202.",
            ["topic", "outcome"],
            registry=self.registry,
        )
        self.spool_bytes = Gauge(
            "rtrl_gateway_spool_bytes",
            "Bytes of events waiting in the on-disk spool.",
            multiprocess_mode="livesum",
            registry=self.registry,
        )
        self.spool_max_bytes = Gauge(
            "rtrl_gateway_spool_max_bytes",
            "The spool's bound (gateway.spool_max_bytes); past it events go to overflow.jsonl.",
            multiprocess_mode="livesum",
            registry=self.registry,
        )
        self.overflow_bytes = Gauge(
            "rtrl_gateway_overflow_bytes",
            "Bytes of the overflow file (spool_dir/overflow.jsonl): dead letters waiting to be requeued by hand.",
            multiprocess_mode="livesum",
            registry=self.registry,
        )
        self.overflow_max_bytes = Gauge(
            "rtrl_gateway_overflow_max_bytes",
            "The overflow file's bound (gateway.overflow_max_bytes); past it events are dropped, counted and logged.",
            multiprocess_mode="livesum",
            registry=self.registry,
        )
        self.kafka_connected = Gauge(
            "rtrl_gateway_kafka_connected",
            "1 when the gateway has a working Kafka producer (0 while unreachable or being replaced).",
            multiprocess_mode="livemin",
            registry=self.registry,
        )
        self.oldest_in_flight = Gauge(
            "rtrl_gateway_publish_oldest_in_flight_seconds",
            "Age of the oldest event handed to Kafka and not yet acknowledged or spooled (0 when none); "
            "never above publish_timeout_s + 1 for long.",
            multiprocess_mode="livemax",
            registry=self.registry,
        )
        self.producer_replaced = Counter(
            "rtrl_gateway_producer_replaced_total",
            "Kafka producers retired because they left events unsettled past their deadline or failed "
            "spool replays in a row.",
            registry=self.registry,
        )
