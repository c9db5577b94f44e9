"""The API's Prometheus metrics (SPEC §5, "Observability"): one registry per API process, every
label value a dashboard reads registered from the start."""

from __future__ import annotations

from typing import TYPE_CHECKING

from atroposd.api.queue import TrajectoryStore

if TYPE_CHECKING:
    from prometheus_client import Histogram

    from atroposd.api.ingest import ParseHelper

__all__ = ["REFUSED_REASONS", "REJECTED_REASONS", "ApiMetrics"]

# The reasons a submission is refused (503) or a request rejected (4xx), as /metrics labels them.
REFUSED_REASONS = ("full", "spool", "inflight", "connections")
REJECTED_REASONS = (
    "invalid",
    "invalid_json",
    "invalid_gzip",
    "too_large",
    "too_long",
    "length_mismatch",
    "score_count",
    "non_finite_score",
    "unknown_env",
    "unauthorized",
    "distill_invalid",
)


class ApiMetrics:
    """Prometheus metrics of one API process (its own registry)."""

    def __init__(self, store: TrajectoryStore, helper: ParseHelper | None = None) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        for name, doc, fn in (
            ("queue_sequences", "Sequences held (queue + buffers + formed batches)", lambda: store.held),
            ("queue_groups", "Groups in the queue", lambda: len(store.queue)),
            (
                "buffered_sequences",
                "Sequences in mixed-size buffers",
                lambda: sum(g.n for b in store.buffers.values() for g in b),
            ),
            ("formed_batches", "Batches formed and not yet served", lambda: len(store.formed)),
            ("capacity_sequences", "max_queued_sequences", lambda: store.capacity),
            ("waiting_submissions", "Submissions waiting for room", lambda: store.waiting),
            ("current_step", "Batches formed (upstream step)", lambda: store.step),
        ):
            Gauge(f"atroposd_api_{name}", doc, registry=r).set_function(fn)
        parsed = Gauge(
            "atroposd_api_parsed_bodies",
            "Posted bodies parsed, by where (helper process or event loop)",
            ["where"],
            registry=r,
        )
        parsed.labels("helper").set_function(lambda: helper.handed if helper is not None else 0)
        parsed.labels("loop").set_function(lambda: helper.on_loop if helper is not None else 0)
        Gauge(
            "atroposd_api_parse_helper_restarts", "Times the parse helper was started again", registry=r
        ).set_function(lambda: helper.restarts if helper is not None else 0)
        self.accepted_groups = Counter("atroposd_api_accepted_groups", "Groups accepted", registry=r)
        self.accepted_sequences = Counter("atroposd_api_accepted_sequences", "Sequences accepted", registry=r)
        self.refused = Counter(
            "atroposd_api_refused",
            "Submissions refused with 503 (queue full or spool write failed)",
            ["reason"],
            registry=r,
        )
        self.rejected = Counter("atroposd_api_rejected", "Requests rejected with a 4xx", ["reason"], registry=r)
        self.batches_served = Counter("atroposd_api_batches_served", "Batches delivered", registry=r)
        self.sequences_served = Counter("atroposd_api_sequences_served", "Sequences delivered", registry=r)
        Gauge(
            "atroposd_api_queue_bytes", "Bytes of groups held (passthrough fields included)", registry=r
        ).set_function(lambda: store.held_bytes)
        Gauge(
            "atroposd_api_spool_set_aside", "Spool records or damaged regions set aside at the last start", registry=r
        ).set_function(lambda: store.spool.set_aside if store.spool is not None else 0)
        Gauge("atroposd_api_spool_ack_failures", "Acknowledgements the spool could not write", registry=r).set_function(
            lambda: store.spool.ack_failures if store.spool is not None else 0
        )
        self.peer_lookups_skipped = Counter(
            "atroposd_api_peer_lookups_skipped",
            "Registrations whose peer pid was not looked up (another lookup running)",
            registry=r,
        )
        self.batch_write_failures = Counter(
            "atroposd_api_batch_write_failures",
            "Batches whose response could not be written (served again)",
            registry=r,
        )
        for reason in REFUSED_REASONS:  # every known label value from the start (dashboards resolve)
            self.refused.labels(reason)
        for reason in REJECTED_REASONS:
            self.rejected.labels(reason)
        self.latency = Histogram(
            "atroposd_api_request_seconds",
            "Request latency",
            ["route"],
            registry=r,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self._latency_by_route: dict[str, Histogram] = {}

    def observe(self, route: str, seconds: float) -> None:
        child = self._latency_by_route.get(route)
        if child is None:
            child = self._latency_by_route[route] = self.latency.labels(route)
        child.observe(seconds)

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
