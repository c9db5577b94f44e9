"""Prometheus metrics of one inference server (``GET /metrics`` on its TCP port).

Generations and tokens served, request latency by route, requests in flight, and the time
generation spent paused for weight syncs (read from the engine's gate). Probes (generation
requests with ``max_tokens ≤ 1``: the health checks of atroposlib's server classes) are counted
apart, in ``atroposd_inference_probes`` and ``atroposd_inference_probe_seconds``, never as
rollouts. For the vLLM engine,
vLLM's own metrics (its global registry, when the engine runs in this process) follow.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prometheus_client.core import CounterMetricFamily

    from atroposd.inference.engine import Engine

__all__ = ["GENERATE_ROUTES", "InferenceMetrics"]

GENERATE_ROUTES = ("generate", "sglang", "trl", "completions", "chat")


class InferenceMetrics:
    def __init__(self, engine: Callable[[], Engine | None]) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "atroposd_inference_requests",
            "Generation requests answered, by route and outcome (ok | error)",
            ["route", "outcome"],
            registry=r,
        )
        self.generations = Counter(
            "atroposd_inference_generations", "Completions generated (one per sample)", registry=r
        )
        self.tokens = Counter("atroposd_inference_generated_tokens", "Tokens generated", registry=r)
        self.latency = Histogram(
            "atroposd_inference_request_seconds",
            "Generation request latency",
            ["route"],
            registry=r,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )
        self.probes = Counter(
            "atroposd_inference_probes",
            "Probes answered (generation requests with "
            "max_tokens <= 1: health checks), by route and outcome; not in the rollout "
            "counts",
            ["route", "outcome"],
            registry=r,
        )
        self.probe_latency = Histogram(
            "atroposd_inference_probe_seconds",
            "Probe latency",
            registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.refused = Counter(
            "atroposd_inference_refused",
            "Requests refused before they were read: connections past the cap, bodies in flight "
            "past their bound (503), too large (413) or too slow (408), by reason",
            ["reason"],
            registry=r,
        )
        for reason in ("connections", "inflight", "too_large", "body_timeout"):
            self.refused.labels(reason)
        self.inflight = Gauge("atroposd_inference_requests_in_flight", "Generation requests being answered", registry=r)
        for route in GENERATE_ROUTES:  # every known label value from the start
            self.latency.labels(route)
            for outcome in ("ok", "error"):
                self.requests.labels(route, outcome)
                self.probes.labels(route, outcome)

        def gate(read: Callable[[Engine], float]) -> Callable[[], float]:
            def value() -> float:
                e = engine()
                return 0.0 if e is None else float(read(e) or 0)

            return value

        Gauge("atroposd_inference_weight_version", "Weight version being served", registry=r).set_function(
            gate(lambda e: e.weight_version)
        )
        Gauge("atroposd_inference_paused", "1 while generation is paused for a weight update", registry=r).set_function(
            gate(lambda e: 1.0 if e.paused else 0.0)
        )
        r.register(_GateCounters(engine))
        Gauge("atroposd_inference_waiting_requests", "Generations held at a paused gate", registry=r).set_function(
            gate(lambda e: e.waiting)
        )
        Gauge("atroposd_inference_engine_ready", "1 once the engine serves", registry=r).set_function(
            lambda: 0.0 if engine() is None else 1.0
        )

    def begin(self) -> float:
        self.inflight.inc()
        return time.perf_counter()

    def end(self, route: str, start: float, *, ok: bool, probe: bool = False) -> None:
        self.inflight.dec()
        if probe:
            self.probe_latency.observe(time.perf_counter() - start)
            self.probes.labels(route, "ok" if ok else "error").inc()
            return
        self.latency.labels(route).observe(time.perf_counter() - start)
        self.requests.labels(route, "ok" if ok else "error").inc()

    def served(self, result: Mapping[str, object]) -> None:
        """Count a generation response's samples and tokens."""
        samples, tokens = _count(result)
        self.generations.inc(samples)
        self.tokens.inc(tokens)

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        out = generate_latest(self.registry)
        return out + _vllm_metrics()


class _GateCounters:
    """The gate's running totals, as counters read at each scrape."""

    def __init__(self, engine: Callable[[], Engine | None]) -> None:
        self.engine = engine

    def collect(self) -> Iterator[CounterMetricFamily]:
        from prometheus_client.core import CounterMetricFamily

        gate = self.engine()
        for name, value, doc in (
            ("atroposd_inference_pauses", gate.pauses if gate else 0, "Pauses for weight updates since start"),
            (
                "atroposd_inference_paused_seconds",
                gate.paused_seconds if gate else 0.0,
                "Seconds generation was paused for weight updates (divided by pauses: the pause per sync)",
            ),
            ("atroposd_inference_weight_updates", gate.updates if gate else 0, "Weight updates applied since start"),
        ):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], float(value or 0))
            yield c


def _count(result: Mapping[str, object]) -> tuple[int, int]:
    """(samples, generated tokens) of a /generate or an OpenAI-style response."""
    ids = result.get("token_ids")
    if isinstance(ids, list):
        return len(ids), sum(len(t) for t in ids if isinstance(t, list))
    choices = result.get("choices")
    usage = result.get("usage")
    tokens = usage.get("completion_tokens", 0) if isinstance(usage, Mapping) else 0
    return (len(choices) if isinstance(choices, list) else 0), int(tokens or 0)


def _vllm_metrics() -> bytes:
    """vLLM's own metrics (``vllm:*``), when vLLM is loaded in this process."""
    import sys

    if "vllm" not in sys.modules:
        return b""
    from prometheus_client import REGISTRY, generate_latest

    try:
        text = generate_latest(REGISTRY)
    except Exception:  # a collector of vLLM's failing must not fail our scrape
        return b""
    keep: list[bytes] = []
    block: list[bytes] = []
    for line in text.split(b"\n"):  # only vLLM's families: the default registry also has process_*
        if line.startswith(b"# HELP "):
            if block:
                keep += block
            block = [line] if line[7:].startswith(b"vllm:") else []
        elif block:
            block.append(line)
    keep += block
    return b"\n".join(line for line in keep if line) + (b"\n" if keep else b"")
