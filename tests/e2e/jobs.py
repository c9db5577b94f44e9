"""Whole jobs for end-to-end tests: a config in a short temporary directory, CLI helpers."""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psutil

from tests.support import atroposd, free_port, free_port_pair, write_config

# Where the built-in model is built once per test session (set by a session fixture in
# tests/conftest.py) and copied from into each job's state directory.
MODEL_CACHE: Path | None = None


def job_config(
    root: Path,
    *,
    steps: int = 30,
    seed: int = 0,
    trainer: Mapping[str, Any] | None = None,
    envs: list[dict[str, Any]] | None = None,
    prebuilt_model: bool = True,
    **sections: Mapping[str, Any],
) -> Path:
    """The embedded job, shortened, with its directories under ``root`` and free ports.

    ``prebuilt_model``: the state directory already holds ``builtin:tiny``, as the daemon would
    build it (the same files, built once per test session), so its start does not build it again;
    False leaves the build to the daemon.
    """
    api_port, inf_port = free_port(), free_port()
    while inf_port == api_port:
        inf_port = free_port()
    cfg: dict[str, Any] = {
        "daemon": {
            "runtime_dir": str(root / "run"),
            "state_dir": str(root / "state"),
            "stop_timeout": 15.0,
            "log_format": "json",
        },
        "api": {"port": api_port},
        "inference": {"port": inf_port, "max_model_len": 64},
        "trainer": {
            "steps": steps,
            "checkpoint_every": max(1, steps // 2),
            "seed": seed,
            "max_token_len": 64,
            **(trainer or {}),
        },
        "env": envs if envs is not None else [{"name": "arithmetic", "builtin": "arithmetic"}],
    }
    for name, body in sections.items():
        cfg[name] = {**cfg.get(name, {}), **body}
    if prebuilt_model and cfg["inference"].get("model", "builtin:tiny") == "builtin:tiny":
        place_builtin_model(
            Path(cfg["daemon"]["state_dir"]), int(cfg["trainer"]["seed"]), int(cfg["inference"]["max_model_len"])
        )
    return write_config(root / "atroposd.toml", cfg)


def place_builtin_model(state_dir: Path, seed: int, max_model_len: int) -> None:
    """Copy ``builtin:tiny`` (built once into MODEL_CACHE) to where a daemon on ``state_dir`` looks."""
    import shutil

    from atroposd.models.tiny import ensure_builtin_model

    if MODEL_CACHE is None:
        return
    built = ensure_builtin_model(MODEL_CACHE, seed, max_model_len)
    dest = state_dir / "models" / built.name
    if not dest.exists():
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(built, dest)


def replica_job_config(
    root: Path,
    *,
    replicas: int = 2,
    metrics_port: bool = False,
    api: Mapping[str, Any] | None = None,
    daemon: Mapping[str, Any] | None = None,
    **kw: Any,
) -> Path:
    """``job_config`` with ``replicas`` (1 or 2) inference replicas on two free consecutive ports
    (replica i on port + i), the API (and, with ``metrics_port``, /metrics) on other free ports."""
    port = free_port_pair()
    taken = {port, port + 1}

    def other_port() -> int:
        chosen = free_port()
        while chosen in taken:
            chosen = free_port()
        taken.add(chosen)
        return chosen

    api = {"port": other_port(), **(api or {})}
    daemon = {**({"metrics_port": other_port()} if metrics_port else {}), **(daemon or {})}
    return job_config(root, inference={"port": port, "replicas": replicas}, api=api, daemon=daemon, **kw)


def replica_health(cfg: Path, replica: int) -> dict[str, Any]:
    """Inference replica ``replica``'s ``/health`` (its generations and weight_version)."""
    import urllib.request

    from atroposd.config import load_config

    config = load_config(cfg)
    port = config.inference.port + replica
    token = config.inference_token()  # with several nodes the servers require one (SPEC §12.3)
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/health", headers={"Authorization": f"Bearer {token}"} if token else {}
    )
    with urllib.request.urlopen(request, timeout=5) as resp:
        body: dict[str, Any] = json.loads(resp.read())
    return body


def segments_of(nonce: str) -> list[str]:
    """The shared-memory segments of one launch of a job (its instance nonce)."""
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"atroposd-{nonce}-")]


def status(cfg: Path) -> dict[str, Any]:
    res = atroposd("status", "-c", str(cfg), "--json", timeout=30)
    assert res.returncode == 0, f"status failed ({res.returncode}): {res.stderr}"
    return json.loads(res.stdout)


def component(st: Mapping[str, Any], name: str) -> dict[str, Any]:
    for c in st["components"]:
        if c["name"] == name:
            return dict(c)
    raise AssertionError(f"no component {name!r} in {[c['name'] for c in st['components']]}")


def metrics(state_dir: Path) -> list[dict[str, Any]]:
    path = state_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def kill9(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def daemon_env() -> dict[str, str]:
    """Children of the CLI run the package from this checkout with this interpreter."""
    return {"PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}


def processes_of_instance(nonce: str) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("ATROPOSD_INSTANCE") == nonce and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (psutil.Error, OSError):
            continue
    return out


# The embedded task, shortened for a learning test: operands 0–4 (25 problems, one-digit sums).
SHORT_TASK: list[dict[str, Any]] = [{"name": "arithmetic", "builtin": "arithmetic", "options": {"max_operand": 4}}]


def problem_lines(log_text: str, limit: int = 30) -> str:
    """The warning and error lines of a JSON log (what went wrong, not the orderly stop after it)."""
    kept = [
        line[:1500]
        for line in log_text.splitlines()
        if '"level":"error"' in line or '"level":"warning"' in line or "Traceback" in line
    ]
    return "--- warnings and errors ---\n" + "\n".join(kept[-limit:])


def run_short_learning_job(cfg: Path, state_dir: Path, *, steps: int = 400) -> list[dict[str, Any]]:
    """``atroposd run`` to the end, then the learning floor: the mean reward and exact-match
    accuracy of the last 10 steps are each at least the first 10's + 0.3. Returns the rows."""
    res = atroposd("run", "-c", str(cfg), env=daemon_env(), timeout=600)
    assert res.returncode == 0, f"run exited {res.returncode}\n{problem_lines(res.stderr)}\n{res.stderr[-3000:]}"
    rows = metrics(state_dir)
    assert len(rows) == steps

    def mean(key: str, part: list[dict[str, Any]]) -> float:
        return float(sum(r[key] for r in part) / len(part))

    first, last = rows[:10], rows[-10:]
    gains = {key: (mean(key, first), mean(key, last)) for key in ("reward_mean", "accuracy")}
    if any(after < before + 0.3 for before, after in gains.values()):
        log = state_dir / "logs" / "daemon.log"
        raise AssertionError(
            f"no learning floor (first 10 steps, last 10): {gains}\n{learning_summary(rows)}\n"
            + (problem_lines(log.read_text()) if log.exists() else "(no daemon.log)")
        )
    return rows


def learning_summary(rows: list[dict[str, Any]], window: int = 50) -> str:
    """What a run that did not learn did, per ``window`` steps: the reward, the staleness, the
    trainer's distance from the sampler's logprobs, the clipped fraction and the learning rate; then
    every detector trip, rollback, dropped or rejected group and replica drift reading."""
    lines = ["steps      reward  stale(max)  |lp diff|  clipped  swapped  lr"]
    for start in range(0, len(rows), window):
        part = rows[start : start + window]

        def avg(key: str, part: list[dict[str, Any]] = part) -> float:
            values = [float(r[key]) for r in part if isinstance(r.get(key), (int, float))]
            return sum(values) / len(values) if values else float("nan")

        lines.append(
            f"{part[0]['step']:>4}-{part[-1]['step']:<4} {avg('reward_mean'):7.3f} {avg('staleness'):6.2f}"
            f"({max(int(r.get('staleness') or 0) for r in part):>2}) {avg('logprob_diff_abs_mean'):10.4f}"
            f" {avg('clipped_fraction'):8.3f} {avg('swapped_token_share'):8.4f}  {part[-1].get('lr')}"
        )
    trips = [(r["step"], r.get("health")) for r in rows if r.get("health") not in ("ok", None)]
    rejected: dict[str, int] = {}
    for r in rows:
        for reason, count in (r.get("rejected_groups") or {}).items():
            rejected[reason] = rejected.get(reason, 0) + int(count)
    readings = [d for r in rows for d in r.get("replica_drift") or [] if isinstance(d, (int, float))]
    drift = f"{len(readings)} readings, largest {max(readings):.3g}" if readings else "none"
    lines += [
        f"detector trips: {trips[:20]}",
        f"rollbacks: {rows[-1].get('rollbacks')}",
        f"dropped groups: {sum(int(r.get('dropped_groups') or 0) for r in rows)}",
        f"rejected groups: {rejected}",
        f"skipped steps: {sum(int(r.get('skipped_steps') or 0) for r in rows)}",
        f"replica drift: {drift}",
        f"replica generations at the end: {rows[-1].get('replica_generations')}",
    ]
    return "\n".join(lines)


def cluster_configs(
    root: Path,
    *,
    nodes: int = 2,
    steps: int = 30,
    seed: int = 0,
    trainer: Mapping[str, Any] | None = None,
    cluster: Mapping[str, Any] | None = None,
    envs: list[dict[str, Any]] | None = None,
    daemon: Mapping[str, Any] | None = None,
    inference: Mapping[str, Any] | None = None,
    token: str | None = None,
) -> list[Path]:
    """One config per node of a job across ``nodes`` "machines" on loopback (SPEC §12.3): the
    same job, each node with its own runtime and state directories and inference ports (its
    own ``node_rank``), one API port and cluster port, a shared ``checkpoint_dir``, one token."""
    import secrets

    token_file = root / "cluster.token"
    token_file.write_text(token or secrets.token_hex(16))
    token_file.chmod(0o600)
    cluster_port = free_port_pair()
    api_port = free_port()
    while api_port in (cluster_port, cluster_port + 1):
        api_port = free_port()
    taken = {cluster_port, cluster_port + 1, api_port}
    out = []
    for rank in range(nodes):
        inf = free_port_pair()
        while {inf, inf + 1} & taken:
            inf = free_port_pair()
        taken |= {inf, inf + 1}
        (root / f"node{rank}").mkdir(exist_ok=True)
        out.append(
            job_config(
                root / f"node{rank}",
                steps=steps,
                seed=seed,
                envs=envs,
                trainer={
                    "device": "cpu",
                    "checkpoint_dir": str(root / "checkpoints"),
                    "batch_size": 16,
                    "micro_batch_size": 4,
                    "join_timeout": 120.0,
                    **(trainer or {}),
                },
                api={"port": api_port},
                inference={"port": inf, **(inference or {})},
                daemon={"stop_timeout": 10.0, **(daemon or {})},
                cluster={
                    "nodes": nodes,
                    "node_rank": rank,
                    "head": "127.0.0.1",
                    "port": cluster_port,
                    "token_file": str(token_file),
                    "heartbeat_timeout": 6.0,
                    "join_timeout": 120.0,
                    **(cluster or {}),
                },
            )
        )
    return out
