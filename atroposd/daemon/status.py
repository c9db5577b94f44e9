"""Status and metrics: ``status --json`` (SPEC §2), the sd_notify line and Prometheus gauges.

Everything here reads the daemon through :class:`DaemonView` — what it is, not how it runs —
so these are assembled the same way from the live daemon or from a test's stand-in.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import anyio.abc

from atroposd.config import Config
from atroposd.daemon.replicas import ReplicaHealth, fetch_health
from atroposd.daemon.specs import api_headers, inference_headers
from atroposd.daemon.state import DaemonState
from atroposd.process.probes import get_ok
from atroposd.process.unit import State, Unit

if TYPE_CHECKING:
    import aiohttp

    from atroposd.daemon.roles import ClusterRole
    from atroposd.daemon.watchdog import StallWatchdog

PROBE_TIMEOUT = 1.5


class TrainerView(Protocol):
    def status(self) -> dict[str, Any]: ...


class DaemonView(Protocol):
    """What status and metrics read of the daemon."""

    @property
    def cfg(self) -> Config: ...
    @property
    def units(self) -> Mapping[str, Unit]: ...
    @property
    def trainer(self) -> TrainerView | None: ...
    @property
    def state(self) -> DaemonState: ...
    @property
    def pid(self) -> int: ...
    @property
    def nonce(self) -> str: ...
    @property
    def start_error(self) -> str | None: ...
    @property
    def watchdog(self) -> StallWatchdog | None: ...
    @property
    def replica_health(self) -> ReplicaHealth | None: ...
    @property
    def cluster(self) -> ClusterRole: ...
    def uptime(self) -> float: ...


def trainer_status(d: DaemonView) -> dict[str, Any] | None:
    """The trainer's status, ``stalled`` (with ``stalled_for_s`` and the stage) while a stall lasts."""
    if d.trainer is None:
        return None
    st = d.trainer.status()
    return d.watchdog.annotate(st) if d.watchdog is not None else st


def _session(timeout: float) -> aiohttp.ClientSession:
    import aiohttp

    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout))


async def status(d: DaemonView) -> dict[str, Any]:
    """The object of ``status --json`` (SPEC §2)."""
    cfg = d.cfg
    components: list[dict[str, Any]] = []
    async with _session(PROBE_TIMEOUT) as session:
        # another node's API is the head's: probed there, not supervised here
        for kind, enabled, url in (
            ("api", cfg.api.enabled and cfg.is_head, f"{cfg.api_url}/info"),
            ("inference", cfg.inference.enabled, f"{cfg.inference_url}/health"),
        ):
            if enabled:
                rows = [u.status() for u in d.units.values() if u.kind == kind]
                if kind == "inference":
                    await _replica_health(cfg, session, rows)
                    _replica_sync(d, rows)
                components += rows
                continue
            # External components are probed, not supervised.
            ok = await get_ok(session, url, api_headers(cfg) if kind == "api" else inference_headers(cfg))
            components.append(
                {
                    "name": kind,
                    "kind": kind,
                    "external": True,
                    "state": "ready" if ok else "unreachable",
                    "pid": None,
                    "restarts": 0,
                    "last_exit": None,
                    "since_s": None,
                    "url": url,
                }
            )
        # trainer ranks 1..N-1 (SPEC §12.1), then the environments
        components += [u.status() for u in d.units.values() if u.kind == "trainer"]
        components += [u.status() for u in d.units.values() if u.kind == "env"]
        queue = await _queue(cfg, session)
    trainer = trainer_status(d)
    _replica_drift(trainer, components)
    out = {
        "state": d.state.value,
        "pid": d.pid,
        "uptime_s": round(d.uptime(), 3),
        "config": cfg.source,
        "instance": d.nonce,
        "components": components,
        "trainer": trainer,
        "queue": queue,
        "start_error": d.start_error,
    }
    out.update(cluster_status(d))
    sandbox = getattr(d, "sandbox", None)
    if sandbox is not None:  # SPEC §16: each environment's live containers, removals by reason
        out["sandbox"] = sandbox.status()
        for row in components:
            if row.get("kind") == "env":
                row["containers"] = sandbox.live.get(row["name"], 0)
    return out


def cluster_status(d: DaemonView) -> dict[str, Any]:
    """Several machines (SPEC §12.3): ``node_rank``; on the head ``nodes`` (every node, its state
    and components), on another node its head and its link's state; on every node ``cluster``
    with the cluster messages it dropped, by reason (``dropped``)."""
    cfg = d.cfg
    if not cfg.cluster.enabled:
        return {}
    return {"node_rank": cfg.node_rank, **d.cluster.status()}


def _size(obj: object) -> int:
    import orjson

    return len(orjson.dumps(obj, default=str))


def _tally(rows: list[Any]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for row in rows:
        state = str(row.get("state")) if isinstance(row, dict) else "?"
        counts[state] = counts.get(state, 0) + 1
    return counts


def fit_status(st: dict[str, Any], limit: int, *, node: int | None = None) -> dict[str, Any]:
    """``st`` cut to at most ``limit`` bytes of JSON (the control frame), with a note in
    ``truncated`` saying what was left out; ``node``: only that node's row (the head's ``nodes``).

    In order, as far as needed: every node's component rows (each node keeps its counts by
    state, ``components_by_state``), then this node's component rows from the end, then node
    rows from the end. Nothing is cut from a status that fits."""
    if node is not None and isinstance(st.get("nodes"), list):
        st = {**st, "nodes": [n for n in st["nodes"] if isinstance(n, dict) and n.get("node_rank") == node]}
    size = _size(st)
    if size <= limit:
        return st
    out = dict(st)
    notes = [f"the status of {size} bytes exceeds the control frame ({limit} bytes)"]
    nodes = out.get("nodes")
    if isinstance(nodes, list) and node is None:
        out["nodes"] = [
            {**n, "components": None, "components_by_state": _tally(n.get("components") or [])}
            if isinstance(n, dict)
            else n
            for n in nodes
        ]
        notes.append(
            "nodes' component rows left out (components_by_state counts them); "
            "ask for one node's with `atroposd status --node N`"
        )
    budget = limit - 1024  # the note and the counts below
    comps = out.get("components")
    if _size(out) > budget and isinstance(comps, list):
        total = len(comps)
        kept = list(comps)
        room = budget - _size({**out, "components": []})
        while kept and _size(kept) > room:
            kept = kept[: max(0, min(len(kept) - 1, len(kept) * room // max(1, _size(kept))))]
        out["components"] = kept
        out["components_total"] = total
        out["components_by_state"] = _tally(comps)
        notes.append(f"{total - len(kept)} of {total} component rows left out (components_by_state counts them)")
    nodes = out.get("nodes")
    if _size(out) > budget and isinstance(nodes, list):
        total = len(nodes)
        kept = list(nodes)
        room = budget - _size({**out, "nodes": []})
        while kept and _size(kept) > room:
            kept = kept[: max(0, min(len(kept) - 1, len(kept) * room // max(1, _size(kept))))]
        out["nodes"] = kept
        out["nodes_total"] = total
        notes.append(f"{total - len(kept)} of {total} node rows left out")
    if _size(out) > budget:  # what remains is not the rows: the scalars only
        out = {
            k: v
            for k, v in out.items()
            if v is None or isinstance(v, (bool, int, float)) or (isinstance(v, str) and len(v) <= 4096)
        }
        out["components"] = []
        notes.append("only the daemon's own fields kept")
    out["truncated"] = "; ".join(notes)
    return out


def replica_index(name: str) -> int:
    """The replica index of an inference component: ``inference`` is 0, ``inference-<i>`` is i."""
    _, _, tail = name.partition("-")
    return int(tail) if tail.isdigit() else 0


async def _replica_health(cfg: Config, session: aiohttp.ClientSession, rows: list[dict[str, Any]]) -> None:
    """Each inference replica's URL, the weight_version it serves and the generations it
    answered (its ``/health``; None when it does not answer), asked of all at once."""
    urls = cfg.inference_urls

    async def one(row: dict[str, Any]) -> None:
        i = replica_index(row["name"])
        url = urls[i] if i < len(urls) else urls[0]
        row.update(url=url, weight_version=None, generations=None)
        data = await fetch_health(session, url, inference_headers(cfg))
        if data is not None:
            row.update(
                weight_version=data.get("weight_version"),
                generations=data.get("generations"),
                quarantined=bool(data.get("quarantined", False)),
            )

    async with anyio.create_task_group() as tg:
        for row in rows:
            tg.start_soon(one, row)


def _replica_sync(d: DaemonView, rows: list[dict[str, Any]]) -> None:
    """The weight-sync mode each replica got (SPEC §7), with the broadcast group's state."""
    weights = getattr(d, "weights", None)
    if weights is None:
        return
    from atroposd.weights.sync import replica_sync_status

    for row in rows:
        row["weight_sync"] = replica_sync_status(weights, replica_index(row["name"]))


def _replica_drift(trainer: dict[str, Any] | None, rows: list[dict[str, Any]]) -> None:
    """Each local inference replica's last canary drift (SPEC §15; None: not checked yet)."""
    sentinel = (trainer or {}).get("sentinel")
    if not isinstance(sentinel, dict):
        return
    drift = sentinel.get("replica_drift") or []
    for row in rows:
        if row.get("kind") == "inference" and not row.get("external"):
            i = replica_index(row["name"])
            row["drift"] = drift[i] if i < len(drift) else None


async def _queue(cfg: Config, session: aiohttp.ClientSession) -> dict[str, Any] | None:
    import aiohttp

    try:
        async with session.get(f"{cfg.api_url}/status", headers=api_headers(cfg)) as resp:
            if resp.status != 200:
                return None
            data = await resp.json(content_type=None)
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    return {
        "sequences": data.get("queued_sequences", data.get("queue_size")),
        "capacity": data.get("capacity") if cfg.api.enabled else None,
    }


def status_line(d: DaemonView) -> str:
    """One line for systemd's STATUS=."""
    units = list(d.units.values())
    ready = sum(u.state == State.READY for u in units)
    text = f"{d.state.value}: {ready}/{len(units)} components ready"
    st = trainer_status(d)
    if st is not None:
        text += f"; trainer {st.get('state')} step {st.get('step')}/{st.get('total_steps')}"
        if st.get("state") == "stalled":
            text += f" for {st.get('stalled_for_s')}s at {st.get('stage')}"
        if st.get("health") not in (None, "ok"):  # SPEC §15: a detector tripped at the last step
            text += f"; health: {st.get('health')}"
        last = st.get("last_rollback")
        if st.get("rollbacks") and isinstance(last, dict):
            text += (
                f"; {st.get('rollbacks')}/{st.get('max_rollbacks')} rollbacks, last at step {last.get('step')} "
                f"({last.get('detector')}) to {Path(str(last.get('to'))).name}, lr {last.get('lr'):.3g}"
            )
    return text
