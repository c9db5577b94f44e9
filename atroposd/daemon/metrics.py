"""One Prometheus ``/metrics`` for the whole job, on ``[daemon] metrics_port``.

At a scrape (see below for how often) the daemon gathers, concurrently:

* the supervisor (``component`` = each unit's name, ``"daemon"`` for its own series): component
  states, restarts, seconds in backoff, the last exit;
* the in-process trainer (``component="trainer"``): step, reward, accuracy, loss, KL, clipped
  fraction, staleness, the per-step time split (waiting for data, compute, weight sync) and
  the sync's gathering of sharded weights, skipped steps, rejected groups by reason;
* each inference replica's generations answered and weight_version (``component`` = the
  replica), from the daemon's background poll of its ``/health`` (:mod:`.replicas`);
* with several machines, the cluster messages this node dropped, by reason
  (``atroposd_cluster_messages_dropped``);
* the API's and every inference server's own ``/metrics`` (supervised or external), each
  within :data:`SCRAPE_TIMEOUT`. A child that does not answer in time shows as
  ``atroposd_component_up{component=...} 0``; the scrape itself never fails or waits longer.

Families from all of them are merged into one exposition (one ``# TYPE`` per family; every
sample gets a ``component`` label, every name the ``atroposd_`` prefix). Labelled series start
at 0 for every known label value, so a dashboard's queries resolve before the first event.

What a scrape costs the daemon is bounded (:class:`Scrapes`): one gathering is in flight at a
time, and its page is kept :data:`CACHE_S` for the scrapes that follow, so a storm of scrapes
makes one fetch of each child; a child's text is read up to :data:`MAX_CHILD_BYTES` (past it
the child counts as down for that scrape); parsing, merging and rendering run in a worker
thread, off the event loop that supervises the job.

Who may read it: the server binds 127.0.0.1 and answers only a Host header that names this
machine (localhost, a loopback address, its own names; 421 otherwise), as the API does, so a
web page cannot reach it through DNS rebinding. A child that requires a bearer token (the API
with ``[api] token``, the inference servers with theirs) has its series re-served only to a
scrape that presents ``[daemon] metrics_token``; other scrapes get them left out
(``atroposd_component_withheld{component=...} 1``), and a wrong token is refused (401).
"""

from __future__ import annotations

import asyncio
import hmac
import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio
import anyio.abc

from atroposd.daemon.specs import api_headers, inference_headers
from atroposd.daemon.status import DaemonView, TrainerView, trainer_status
from atroposd.logs import get_logger
from atroposd.net import host_allowed, own_host_names
from atroposd.process.unit import State

if TYPE_CHECKING:
    import aiohttp
    from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

    from atroposd.config import Config
    from atroposd.daemon.replicas import ReplicaHealth

__all__ = [
    "CACHE_S",
    "MAX_CHILD_BYTES",
    "SCRAPE_TIMEOUT",
    "Scrapes",
    "Target",
    "exposition",
    "scrape_targets",
    "serve_metrics",
]

log = get_logger(__name__)

SCRAPE_TIMEOUT = 2.0  # per child, all children at once
CACHE_S = 1.0  # a gathered page serves the scrapes of the next second
MAX_CHILD_BYTES = 8 << 20  # of one child's text; past it the child counts as down
PREFIX = "atroposd_"

# The trainer's states (SPEC §2) and its parts of a step, as label values.
TRAINER_STATES = ("waiting", "training", "stalled", "checkpointing", "finished", "failed", "stopped")
STEP_PARTS = ("data_wait", "compute", "sync")
# The last step's timeline (atroposd.timeline): part label, metrics.jsonl key. The trainer's parts
# overlap the split above (the optimizer step is inside the pause, the pause inside sync); the
# rollout parts are means over the batch's groups.
TIMELINE_PARTS = (
    ("prepare", "prepare_s"),
    ("optimizer", "optimizer_s"),
    ("pause", "pause_s"),
    ("fetch", "fetch_s"),
    ("rollout_gate", "rollout_gate_s"),
    ("rollout_generate", "rollout_generate_s"),
    ("rollout_delivery", "rollout_delivery_s"),
)
# Gauges of the last step: metric suffix, metrics.jsonl key, help.
_LAST_STEP = (
    ("reward_std", "reward_std", "Standard deviation of the rewards of the last batch"),
    ("kl", "mean_kl", "Mean k3 KL to the reference of the last step"),
    ("clipped_fraction", "clipped_fraction", "Fraction of tokens whose ratio was clipped in the last step"),
    ("staleness", "staleness", "Weight versions between the trained policy and the oldest rollout of the last batch"),
    ("grad_norm", "grad_norm", "Gradient norm of the last step (before clipping)"),
    ("mean_ratio", "mean_ratio", "Mean policy ratio of the last step"),
    ("learning_rate", "lr", "Learning rate of the last step"),
    ("batch_tokens", "tokens", "Tokens in the last batch"),
    ("batch_sequences", "sequences", "Sequences in the last batch"),
    (
        "swapped_token_share",
        "swapped_token_share",
        "Share of the last batch's trained completion tokens sampled after a weight swap (in-flight updates)",
    ),
)
_STATUS_GAUGES = (
    ("step", "step", "Optimizer steps done"),
    ("total_steps", "total_steps", "Optimizer steps the run trains"),
    ("weight_version", "weight_version", "Weights served"),
    ("reward_mean", "reward_mean", "Mean reward of the last batch"),
    ("accuracy", "accuracy", "Exact-match accuracy of the last batch"),
    ("loss", "loss", "Loss of the last step"),
    ("steps_per_s", "steps_per_s", "Optimizer steps per second"),
)


@dataclass(frozen=True)
class Target:
    """A child's ``/metrics``: ``component`` is the label its series get."""

    component: str
    url: str
    headers: dict[str, str]

    @property
    def protected(self) -> bool:
        """Its series need a token: re-served only to a scrape with ``[daemon] metrics_token``."""
        return "Authorization" in self.headers


def scrape_targets(d: DaemonView) -> list[Target]:
    """The API and every inference server, supervised or external."""
    cfg = d.cfg
    out = []
    api = [u.name for u in d.units.values() if u.kind == "api"] if cfg.api.enabled else ["api"]
    out += [Target(name, f"{cfg.api_url}/metrics", api_headers(cfg)) for name in api]
    if cfg.inference.enabled:  # each server at the URL its readiness probe uses (replicas included)
        out += [
            Target(u.name, f"{_base_url(u, cfg.inference_url)}/metrics", inference_headers(cfg))
            for u in d.units.values()
            if u.kind == "inference"
        ]
    else:
        out.append(Target("inference", f"{cfg.inference_url}/metrics", inference_headers(cfg)))
    return out


def _base_url(unit: object, default: str) -> str:
    url = getattr(getattr(getattr(unit, "spec", None), "probe", None), "url", None)
    return url.rstrip("/") if isinstance(url, str) and url.startswith("http") else default


# ----------------------------------------------------------------------------- families


def _gauge(name: str, doc: str, labels: Iterable[str] = ()) -> GaugeMetricFamily:
    from prometheus_client.core import GaugeMetricFamily

    return GaugeMetricFamily(name, doc, labels=list(labels))


def _counter(name: str, doc: str, labels: Iterable[str] = ()) -> CounterMetricFamily:
    from prometheus_client.core import CounterMetricFamily

    return CounterMetricFamily(name, doc, labels=list(labels))


def _num(x: object) -> float:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else math.nan


def supervisor_families(d: DaemonView) -> Iterator[Metric]:
    """What the supervisor knows of each unit, beyond :class:`DaemonCollector`'s families."""
    state = _gauge("atroposd_daemon_state", "1 for the state the daemon is in", ["component", "state"])
    for value in ("starting", "running", "degraded", "stopping"):
        state.add_metric(["daemon", value], 1.0 if d.state.value == value else 0.0)
    yield state
    backoff = _counter(
        "atroposd_component_backoff_seconds", "Seconds each component waited to be restarted", ["component", "kind"]
    )
    code = _gauge(
        "atroposd_component_last_exit_code",
        "Exit status of the last exit (negative: the signal); NaN before the first",
        ["component", "kind"],
    )
    at = _gauge(
        "atroposd_component_last_exit_timestamp_seconds",
        "When the last exit happened (Unix time); NaN before the first",
        ["component", "kind"],
    )
    for u in list(d.units.values()):
        labels = [u.name, u.kind]
        backoff.add_metric(labels, float(getattr(u, "backoff_s", 0.0)))
        code.add_metric(labels, float(u.last_exit.code) if u.last_exit else math.nan)
        at.add_metric(labels, float(u.last_exit.at) if u.last_exit else math.nan)
    yield backoff
    yield code
    yield at


def trainer_families(trainer: TrainerView) -> Iterator[Metric]:
    """The in-process trainer's status and its last metrics row."""
    st = trainer.status()
    view = trainer.metrics_view() if hasattr(trainer, "metrics_view") else {}
    last = view.get("last") or {}
    labels = ["component"]
    comp = ["trainer"]
    for suffix, key, doc in _STATUS_GAUGES:
        g = _gauge(f"atroposd_trainer_{suffix}", doc, labels)
        g.add_metric(comp, _num(st.get(key)))
        yield g
    for suffix, key, doc in _LAST_STEP:
        g = _gauge(f"atroposd_trainer_{suffix}", doc, labels)
        g.add_metric(comp, _num(last.get(key)))
        yield g
    state = _gauge("atroposd_trainer_state", "1 for the state the trainer is in", ["component", "state"])
    for value in TRAINER_STATES:
        state.add_metric(["trainer", value], 1.0 if st.get("state") == value else 0.0)
    yield state
    keys = {"data_wait": "batch_wait_s", "compute": "compute_s", "sync": "sync_s"}
    split = _gauge(
        "atroposd_trainer_last_step_seconds",
        "The last step's time: waiting for data, compute "
        "(loss and backward), weight sync (optimizer step and publishing the weights)",
        ["component", "part"],
    )
    totals = _counter(
        "atroposd_trainer_step_seconds",
        "Seconds spent per part of a step since the trainer started (data_wait, compute, sync)",
        ["component", "part"],
    )
    seconds = view.get("seconds") or {}
    for part in STEP_PARTS:
        split.add_metric(["trainer", part], _num(last.get(keys[part])))
        totals.add_metric(["trainer", part], float(seconds.get(part, 0.0)))
    yield split
    yield totals
    timeline = _gauge(
        "atroposd_trainer_last_step_timeline_seconds",
        "The last step's timeline: batch "
        "preparation, the optimizer step, the whole pause around it, the GET /batch; and, "
        "per group of its batch (mean), the time at the environment's gate, generating, and "
        "from posting to the trainer",
        ["component", "part"],
    )
    for part, key in TIMELINE_PARTS:
        timeline.add_metric(["trainer", part], _num(last.get(key)))
    yield timeline
    yield from sentinel_families(st.get("sentinel"))
    # the gathering of sharded weights (several ranks), inside the sync part
    gather = _gauge(
        "atroposd_trainer_last_gather_seconds",
        "Seconds the last step's weight sync spent "
        "gathering the sharded weights (part of its sync seconds; 0 with one rank)",
        labels,
    )
    gather.add_metric(comp, _num(last.get("gather_s")))
    yield gather
    gathered = _counter(
        "atroposd_trainer_gather_seconds",
        "Seconds weight syncs spent gathering the sharded weights since the trainer started (part of the sync seconds)",
        labels,
    )
    gathered.add_metric(comp, float(seconds.get("gather", 0.0)))
    yield gathered
    tokens = _counter("atroposd_trainer_tokens", "Tokens trained on since the trainer started", labels)
    tokens.add_metric(comp, float(view.get("tokens_total", 0)))
    yield tokens
    skipped = _counter("atroposd_trainer_skipped_steps", "Steps skipped for a non-finite loss or gradient", labels)
    skipped.add_metric(comp, float(st.get("skipped_steps") or 0))
    yield skipped
    rejected = _counter(
        "atroposd_trainer_rejected_groups", "Groups the trainer refused, by reason", ["component", "reason"]
    )
    counts = dict(st.get("rejected_groups") or {})
    for reason in dict.fromkeys([*view.get("rejected_reasons", ()), *counts]):
        rejected.add_metric(["trainer", reason], float(counts.get(reason, 0)))
    yield rejected
    filtered = _counter(
        "atroposd_trainer_filtered_groups",
        "Groups filter_groups dropped (all scores equal) since the trainer started",
        labels,
    )
    filtered.add_metric(comp, float(st.get("filtered_groups") or 0))
    yield filtered
    failures = _counter("atroposd_trainer_checkpoint_failures", "Checkpoint writes that failed", labels)
    failures.add_metric(comp, float(st.get("checkpoint_failures") or 0))
    yield failures
    dropped = _counter("atroposd_trainer_metrics_dropped", "metrics.jsonl lines that could not be written", labels)
    dropped.add_metric(comp, float(st.get("metrics_dropped") or 0))
    yield dropped


def sentinel_families(sentinel: object) -> Iterator[Metric]:
    """SPEC §15: each replica's last canary drift, whether it is quarantined, and the sentinel's
    resyncs and time per check (the trainer's status; nothing while the sentinel is off)."""
    if not isinstance(sentinel, dict):
        return
    drift = _gauge(
        "atroposd_replica_drift",
        "Each inference replica's last canary drift: mean |trainer logprob "
        "- replica logprob| per greedy canary token (NaN before its first check)",
        ["replica"],
    )
    quarantined = _gauge(
        "atroposd_replica_quarantined",
        "1 while the sentinel keeps the replica out of rotation (its generation routes answer 503)",
        ["replica"],
    )
    held = sentinel.get("quarantined") or {}
    for i, value in enumerate(sentinel.get("replica_drift") or []):
        drift.add_metric([str(i)], _num(value))
        quarantined.add_metric([str(i)], 1.0 if str(i) in held else 0.0)
    yield drift
    yield quarantined
    for name, key, doc in (
        ("resyncs", "resyncs", "Replicas synced again after a drift over drift_limit"),
        ("restarts", "restarts", "Replicas restarted after a resync did not bring the drift back"),
        ("checks", "checks", "Canary checks of one replica"),
    ):
        c = _counter(f"atroposd_sentinel_{name}", doc, [])
        c.add_metric([], float(sentinel.get(key) or 0))
        yield c
    per = _gauge(
        "atroposd_sentinel_check_seconds",
        "Mean seconds of one replica's canary check (generation and the trainer's scoring)",
        [],
    )
    per.add_metric([], _num(sentinel.get("check_s")))
    yield per


def replica_families(health: ReplicaHealth) -> Iterator[Metric]:
    """Each inference replica's generations and weight_version, as the daemon's poll of its
    ``/health`` last saw them (also while the replica does not answer)."""
    gens = _counter(
        "atroposd_replica_generations",
        "Generation requests each inference replica answered (its "
        "/health, polled every 2 s; the last known value while it does not answer)",
        ["component"],
    )
    version = _gauge(
        "atroposd_replica_weight_version",
        "Weight version each inference replica serves (its "
        "/health, polled every 2 s; the last known value; NaN before it answered)",
        ["component"],
    )
    for r in health.replicas:
        gens.add_metric([r.name], float(r.generations or 0))
        version.add_metric([r.name], _num(r.weight_version))
    yield gens
    yield version


# ----------------------------------------------------------------------------- merging


class _Merged:
    """Families by name, in first-seen order; the first component to give a series keeps it."""

    def __init__(self) -> None:
        self.families: dict[str, Metric] = {}
        self._seen: set[tuple[str, tuple[tuple[str, str], ...]]] = set()

    def add(self, family: Metric, component: str) -> None:
        from prometheus_client.metrics_core import Metric as MetricCls
        from prometheus_client.samples import Sample

        if family.type == "gauge" and family.name.endswith("_created"):
            return  # a counter's creation time: noise on a merged page
        name = family.name if family.name.startswith(PREFIX) else PREFIX + family.name
        have = self.families.get(name)
        if have is not None and have.type != family.type:
            log.warning(
                "metrics family dropped: its type differs from another component's",
                family=name,
                component=component,
                type=family.type,
                other=have.type,
            )
            return
        if have is None:
            have = self.families[name] = MetricCls(name, family.documentation, family.type, family.unit)
        for s in family.samples:
            sample_name = name + s.name[len(family.name) :] if s.name.startswith(family.name) else PREFIX + s.name
            labels = {"component": component, **s.labels} if "component" not in s.labels else dict(s.labels)
            key = (sample_name, tuple(sorted(labels.items())))
            if key in self._seen:
                continue
            self._seen.add(key)
            have.samples.append(Sample(sample_name, labels, s.value, s.timestamp, s.exemplar))

    def render(self) -> bytes:
        from prometheus_client import CollectorRegistry, generate_latest

        families = list(self.families.values())

        class _Fixed:
            def collect(self) -> Iterator[Metric]:
                return iter(families)

        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Fixed())
        return generate_latest(registry)


def _component_of(family: Metric) -> str:
    """The component of a family of the daemon's own collector without a ``component`` label."""
    return "trainer" if family.name.startswith("atroposd_trainer_") else "daemon"


async def _scrape(session: aiohttp.ClientSession, target: Target, limit: int | None = None) -> bytes | None:
    """A child's text, at most ``limit`` bytes (default :data:`MAX_CHILD_BYTES`; None: no
    answer, an error, or more than that)."""
    import aiohttp

    limit = MAX_CHILD_BYTES if limit is None else limit

    try:
        async with session.get(target.url, headers=target.headers) as resp:
            if resp.status != 200 or (resp.content_length or 0) > limit:
                return None
            chunks: list[bytes] = []
            size = 0
            async for chunk in resp.content.iter_chunked(1 << 16):
                size += len(chunk)
                if size > limit:
                    log.warning(
                        "a component's metrics exceed the size cap; left out",
                        component=target.component,
                        limit_bytes=limit,
                    )
                    return None
                chunks.append(chunk)
            return b"".join(chunks)
    except (aiohttp.ClientError, OSError, TimeoutError):
        return None


def _parse_child(component: str, text: bytes | None) -> list[Metric] | None:
    """A child's families (worker thread); None when it sent nothing usable."""
    from prometheus_client.parser import text_string_to_metric_families

    if text is None:
        return None
    try:
        return list(text_string_to_metric_families(text.decode("utf-8")))
    except (ValueError, UnicodeDecodeError, IndexError, KeyError, TypeError) as exc:
        log.warning("a component's metrics could not be parsed", component=component, error=str(exc)[:200])
        return None


def _own_families(d: DaemonView) -> list[tuple[Metric, str]]:
    """The daemon's own families with their component (on the loop: they read live state)."""
    out: list[tuple[Metric, str]] = [(f, _component_of(f)) for f in DaemonCollector(d).collect()]
    out += [(f, "daemon") for f in supervisor_families(d)]
    if d.trainer is not None:
        try:
            out += [(f, "trainer") for f in trainer_families(d.trainer)]
        except Exception as exc:  # a defect in the trainer's view must not fail the scrape
            log.warning("trainer metrics failed", error=f"{type(exc).__name__}: {exc}")
    if d.replica_health is not None:
        out += [(f, "daemon") for f in replica_families(d.replica_health)]
    dropped = d.cluster.dropped()
    if dropped is not None:
        out += [(f, "daemon") for f in cluster_families(dropped)]
    sandbox = getattr(d, "sandbox", None)
    if sandbox is not None:  # SPEC §16: live containers per environment, removals by reason
        out += [(f, "daemon") for f in sandbox.families()]
    weights = getattr(d, "weights", None)
    if weights is not None and d.cfg.inference.enabled:
        out += [(f, "daemon") for f in weight_sync_families(d.cfg, weights)]
    return out


def cluster_families(counts: dict[str, int]) -> Iterator[Metric]:
    """Several machines (SPEC §12.3): the cluster messages this node dropped, never acted on, by
    reason (a bad signature, the other direction, another session, a sequence number not above
    the last, a join for another connection's challenge, fields that do not check, no message)."""
    from atroposd.cluster.messages import REASONS

    dropped = _counter(
        "atroposd_cluster_messages_dropped", "Cluster endpoint messages dropped (never acted on), by reason", ["reason"]
    )
    for reason in dict.fromkeys([*REASONS, *counts]):
        dropped.add_metric([reason], float(counts.get(reason, 0)))
    yield dropped


def weight_sync_families(cfg: Config, weights: object) -> Iterator[Metric]:
    """Each replica's weight-sync mode, and for ``broadcast`` its group: formations, failures,
    the last transfer's seconds."""
    from atroposd.daemon.specs import inference_name
    from atroposd.weights.sync import replica_sync_status

    rows = [(inference_name(cfg, i), replica_sync_status(weights, i)) for i in range(cfg.inference.replicas)]
    mode = _gauge(
        "atroposd_replica_weight_sync", "The weight-sync mode each inference replica got (1)", ["component", "mode"]
    )
    for name, row in rows:
        mode.add_metric([name, str(row.get("mode"))], 1.0)
    yield mode
    if not any(row.get("mode") == "broadcast" for _, row in rows):
        return
    formed = _gauge(
        "atroposd_replica_broadcast_group", "1 while the replica's broadcast group is formed", ["component"]
    )
    formations = _counter(
        "atroposd_replica_broadcast_formations", "Broadcast groups formed with the replica", ["component"]
    )
    failures = _counter(
        "atroposd_replica_broadcast_failures",
        "Broadcast syncs of the replica that failed: "
        "a group that did not form within its deadline (form), a stream that broke (send)",
        ["component", "kind"],
    )
    transfer = _gauge(
        "atroposd_replica_broadcast_last_transfer_seconds",
        "Seconds the replica's last broadcast sync took from the plan's check to its last bucket (NaN before one)",
        ["component"],
    )
    for name, row in rows:
        formed.add_metric([name], 1.0 if row.get("group") == "formed" else 0.0)
        formations.add_metric([name], float(row.get("formations") or 0))
        failures.add_metric([name, "form"], float(row.get("form_failures") or 0))
        failures.add_metric([name, "send"], float(row.get("send_failures") or 0))
        transfer.add_metric([name], _num(row.get("last_transfer_s")))
    yield formed
    yield formations
    yield failures
    yield transfer


def _assemble(
    targets: list[Target],
    texts: dict[str, bytes | None],
    took: dict[str, float],
    deadline_s: float,
    own: list[tuple[Metric, str]],
    trainer: bool,
    withheld: list[str],
) -> bytes:
    """Parse the children's texts and merge everything into one page (worker thread)."""
    merged = _Merged()
    up = _gauge(
        "atroposd_component_up",
        "1 when the component answered this scrape (the daemon and the trainer: always 1)",
        ["component"],
    )
    up.add_metric(["daemon"], 1.0)
    if trainer:
        up.add_metric(["trainer"], 1.0)
    duration = _gauge(
        "atroposd_component_scrape_seconds",
        "How long the component's /metrics took to answer (or the deadline)",
        ["component"],
    )
    hidden = _gauge(
        "atroposd_component_withheld",
        "1 when the component's series need a token and this scrape "
        "did not present [daemon] metrics_token: they are left out",
        ["component"],
    )
    parsed: list[tuple[str, list[Metric]]] = []
    for t in targets:
        families = _parse_child(t.component, texts[t.component])
        up.add_metric([t.component], 0.0 if families is None else 1.0)
        duration.add_metric([t.component], took.get(t.component, deadline_s))
        if families is not None:
            parsed.append((t.component, families))
    for component in withheld:
        hidden.add_metric([component], 1.0)
    merged.add(up, "daemon")
    merged.add(duration, "daemon")
    if withheld:
        merged.add(hidden, "daemon")
    for family, component in own:
        merged.add(family, component)
    for component, families in parsed:
        for family in families:
            merged.add(family, component)
    return merged.render()


async def exposition(d: DaemonView, *, deadline_s: float = SCRAPE_TIMEOUT, protected: bool = True) -> bytes:
    """The whole job's metrics, as Prometheus text; ``protected`` False leaves out the children
    whose series need a token (not even fetched)."""
    import aiohttp

    every = scrape_targets(d)
    targets = [t for t in every if protected or not t.protected]
    withheld = [t.component for t in every if t not in targets]
    texts: dict[str, bytes | None] = {t.component: None for t in targets}
    took: dict[str, float] = {}

    async def one(session: aiohttp.ClientSession, target: Target) -> None:
        start = time.monotonic()
        with anyio.move_on_after(deadline_s):
            texts[target.component] = await _scrape(session, target)
        took[target.component] = time.monotonic() - start

    if targets:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=deadline_s)) as session:
            async with anyio.create_task_group() as tg:
                for t in targets:
                    tg.start_soon(one, session, t)
    own = _own_families(d)
    return await anyio.to_thread.run_sync(
        _assemble, targets, texts, took, deadline_s, own, d.trainer is not None, withheld
    )


class Scrapes:
    """One gathering in flight at a time, its page kept ``cache_s`` (per kind of page: with or
    without the token-protected series); a scraper that goes away does not cancel it."""

    def __init__(self, d: DaemonView, *, cache_s: float = CACHE_S, deadline_s: float = SCRAPE_TIMEOUT) -> None:
        self.d = d
        self.cache_s = cache_s
        self.deadline_s = deadline_s
        self.gathered = 0  # gatherings made (each one fetch of every child)
        self._pages: dict[bool, tuple[float, bytes]] = {}
        self._inflight: dict[bool, asyncio.Future[bytes]] = {}

    async def page(self, *, protected: bool) -> bytes:
        cached = self._pages.get(protected)
        if cached is not None and time.monotonic() - cached[0] < self.cache_s:
            return cached[1]
        fut = self._inflight.get(protected)
        if fut is None:
            fut = self._inflight[protected] = asyncio.ensure_future(self._gather(protected))
        return await asyncio.shield(fut)

    async def _gather(self, protected: bool) -> bytes:
        try:
            self.gathered += 1
            body = await exposition(self.d, deadline_s=self.deadline_s, protected=protected)
            self._pages[protected] = (time.monotonic(), body)
            return body
        finally:
            self._inflight.pop(protected, None)


def _bearer_ok(header: str, token: str) -> bool:
    try:
        given = header.encode("utf-8")
    except UnicodeError:
        return False
    return hmac.compare_digest(given, f"Bearer {token}".encode())


# ----------------------------------------------------------------------------- the supervisor's own

_TRAINER_GAUGES = (
    ("step", "Optimizer steps done"),
    ("weight_version", "Weights served"),
    ("reward_mean", "Mean reward of the last batch"),
    ("accuracy", "Exact-match accuracy of the last batch"),
    ("loss", "Loss of the last step"),
    ("steps_per_s", "Optimizer steps per second"),
)


class DaemonCollector:
    """Component states, restarts and trainer progress as Prometheus gauges."""

    def __init__(self, daemon: DaemonView) -> None:
        self.daemon = daemon

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        d = self.daemon
        up = GaugeMetricFamily("atroposd_uptime_seconds", "Seconds since the daemon started")
        up.add_metric([], d.uptime())
        yield up
        state = GaugeMetricFamily(
            "atroposd_component_state", "1 for the state each component is in", labels=["component", "kind", "state"]
        )
        restarts = CounterMetricFamily(
            "atroposd_component_restarts", "Restarts of each component", labels=["component", "kind"]
        )
        dropped = CounterMetricFamily(
            "atroposd_component_log_dropped_bytes",
            "Output a component wrote faster than its log could take",
            labels=["component", "kind"],
        )
        for u in list(d.units.values()):
            for st in State:
                state.add_metric([u.name, u.kind, st.value], 1.0 if u.state == st else 0.0)
            restarts.add_metric([u.name, u.kind], u.restarts)
            dropped.add_metric([u.name, u.kind], u.status()["log_dropped_bytes"])
        yield state
        yield restarts
        yield dropped
        hung = CounterMetricFamily(
            "atroposd_component_hung", "Times each component was stopped as hung", labels=["component", "kind"]
        )
        for u in list(d.units.values()):
            hung.add_metric([u.name, u.kind], u.hung_count)
        yield hung
        t = trainer_status(d)
        if t is not None:
            for key, help_text in _TRAINER_GAUGES:
                if isinstance(t.get(key), (int, float)):
                    g = GaugeMetricFamily(f"atroposd_trainer_{key}", help_text)
                    g.add_metric([], float(t[key]))
                    yield g
            from atroposd.daemon.watchdog import STAGES

            stalled = GaugeMetricFamily(
                "atroposd_trainer_stalled_seconds",
                "Seconds the trainer has made no step, by the stage that is stuck (0 while it advances)",
                labels=["stage"],
            )
            for stage in STAGES:
                stalled.add_metric([stage], float(t.get("stalled_for_s") or 0.0) if t.get("stage") == stage else 0.0)
            yield stalled


async def serve_metrics(
    d: DaemonView, port: int, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
) -> None:
    """The whole job's metrics on 127.0.0.1:``port`` (:class:`Scrapes`: one gathering at a time,
    cached :data:`CACHE_S`)."""
    from aiohttp import web
    from prometheus_client import CONTENT_TYPE_LATEST

    scrapes = Scrapes(d)
    own = own_host_names()
    token = d.cfg.daemon.metrics_token

    async def metrics(request: web.Request) -> web.Response:
        if not host_allowed(request.headers.get("Host"), own):
            return web.Response(
                status=421,
                text="Host header names another host; these metrics answer only to "
                "localhost, loopback addresses and this machine's names\n",
            )
        auth = request.headers.get("Authorization")
        if auth is not None and not (token and _bearer_ok(auth, token)):
            return web.Response(
                status=401, text="wrong bearer token ([daemon] metrics_token)\n", headers={"WWW-Authenticate": "Bearer"}
            )
        body = await scrapes.page(protected=auth is not None)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", port)
        await site.start()
        task_status.started()
        await anyio.sleep_forever()
    finally:
        with anyio.CancelScope(shield=True):
            await runner.cleanup()
