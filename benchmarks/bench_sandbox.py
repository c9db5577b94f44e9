"""The environments' engine sockets (SPEC §16) against the engine's own socket, side by side.

A real engine (podman's Docker-compatible service with its own storage in a temporary directory,
as the tests run it; or ``--engine unix:///...`` with ``--image`` there) and a daemon whose one
environment replica has ``[sandbox] engine`` set. docker-py, the client agent environments use,
then measures in ABAB order (``--rounds`` of each):

* create-start-wait-remove of a container running ``true``, through the replica's socket and
  through the engine's own;
* an exec round trip (``exec_run(["true"])``: create, start with an upgrade, inspect) in one
  long-lived container, both ways;

and the time ``atroposd stop`` takes when the environment has ``--containers`` (100) containers
whose first process ignores SIGTERM (kill, then remove, in parallel), beside the engine's own
forced removal of such a container one at a time (``--reference`` of them, seconds each). Goal: at most 1.1x the
engine's latency. Prints a table and a JSON line.

    .venv/bin/python benchmarks/bench_sandbox.py [--rounds 30] [--containers 100]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.sandbox.engine import IMAGE, Podman, missing  # noqa: E402


def atroposd(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "atroposd", *args], capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


def write_config(d: Path, engine: str, command: list[str], max_containers: int) -> Path:
    from tests.support import free_port, write_config

    sections: dict[str, Any] = {
        "daemon": {"runtime_dir": str(d / "run"), "state_dir": str(d / "state"), "stop_timeout": 15.0},
        "api": {"enabled": False, "url": f"http://127.0.0.1:{free_port()}"},
        "inference": {"enabled": False, "url": f"http://127.0.0.1:{free_port()}"},
        "trainer": {"enabled": False},
        "sandbox": {"engine": engine, "max_containers": max_containers},
        # the environment sleeps while the benchmark drives its socket: no liveness checks
        "env": [{"name": "bench", "command": command, "ready": "started", "start_seconds": 0.2, "live_interval": 0}],
    }
    return write_config(d / "atroposd.toml", sections)


def lifecycle(client: Any, image: str) -> float:
    start = time.perf_counter()
    c = client.containers.create(image, ["true"])
    c.start()
    c.wait(timeout=60)
    c.remove()
    return time.perf_counter() - start


def exec_trip(box: Any) -> float:
    start = time.perf_counter()
    result = box.exec_run(["true"])
    assert result.exit_code == 0, result
    return time.perf_counter() - start


def side_by_side(proxied: Any, direct: Any, image: str, rounds: int) -> dict[str, dict[str, list[float]]]:
    out: dict[str, dict[str, list[float]]] = {"lifecycle": {"atroposd": [], "engine": []}, "exec": {}}
    out["exec"] = {"atroposd": [], "engine": []}
    for _ in range(2):  # warm-up: connections, the image's first use
        lifecycle(proxied, image)
        lifecycle(direct, image)
    for i in range(rounds):
        order = (
            [("atroposd", proxied), ("engine", direct)] if i % 2 == 0 else [("engine", direct), ("atroposd", proxied)]
        )
        for name, client in order:
            out["lifecycle"][name].append(lifecycle(client, image))
    box = proxied.containers.run(image, ["sh", "-c", "while :; do sleep 3600; done"], detach=True)
    try:
        same = direct.containers.get(box.id)
        for _ in range(3):
            exec_trip(box)
            exec_trip(same)
        for i in range(rounds * 3):
            pair = [("atroposd", box), ("engine", same)] if i % 2 == 0 else [("engine", same), ("atroposd", box)]
            for name, target in pair:
                out["exec"][name].append(exec_trip(target))
    finally:
        direct.api.kill(box.id)
        box.remove(force=True)
    return out


def stop_time(d: Path, engine: str, image: str, n: int, podman: Podman | None) -> dict[str, float]:
    ids = d / "ids"
    command = [sys.executable, str(REPO / "tests" / "child_scripts" / "sandbox_env.py"), str(ids), str(n), image]
    cfg = write_config(d, engine, command, max_containers=n + 8)
    r = atroposd("start", "-c", str(cfg))
    assert r.returncode == 0, r.stderr[-2000:]
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and (not ids.exists() or len(ids.read_text().split()) < n):
        time.sleep(0.2)
    assert ids.exists() and len(ids.read_text().split()) == n, "the environment did not start its containers"
    start = time.perf_counter()
    r = atroposd("stop", "-c", str(cfg))
    took = time.perf_counter() - start
    assert r.returncode == 0, r.stderr[-2000:]
    left = len(podman.containers("label=atroposd.env=bench")) if podman is not None else -1
    return {"stop_s": took, "left": float(left)}


def one_at_a_time(direct: Any, image: str, n: int) -> float:
    """The reference: the engine's own forced removal, one container at a time, of containers
    whose first process ignores SIGTERM (what ``docker rm -f`` in a loop does); seconds each."""
    boxes = [
        direct.containers.run(image, ["sh", "-c", "trap '' TERM; while true; do sleep 1; done"], detach=True)
        for _ in range(n)
    ]
    time.sleep(1.0)  # each shell has set its trap
    start = time.perf_counter()
    for box in boxes:
        box.remove(force=True)
    return (time.perf_counter() - start) / max(1, n)


def summary(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"median_ms": statistics.median(xs) * 1e3, "p90_ms": xs[int(0.9 * (len(xs) - 1))] * 1e3}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--containers", type=int, default=100)
    parser.add_argument("--engine", default="", help="an engine's socket (unix:///...); default: podman of its own")
    parser.add_argument("--image", default=IMAGE)
    parser.add_argument(
        "--reference", type=int, default=2, help="containers the engine removes one at a time, for the reference"
    )
    args = parser.parse_args()
    import docker

    root = Path(tempfile.mkdtemp(prefix="apd-bench-", dir="/tmp"))
    podman: Podman | None = None
    engine = args.engine
    if not engine:
        why = missing()
        if why:
            print(f"no engine: {why}", file=sys.stderr)
            return 1
        (root / "pm").mkdir()
        podman = Podman(root / "pm")
        podman.start()
        engine = podman.url
    sleeper = [sys.executable, "-c", "import time\nwhile True: time.sleep(1)"]
    job = root / "job"
    job.mkdir()
    cfg = write_config(job, engine, sleeper, max_containers=32)
    try:
        r = atroposd("start", "-c", str(cfg))
        assert r.returncode == 0, r.stderr[-2000:]
        proxied = docker.DockerClient(base_url=f"unix://{job / 'run' / 'sandbox' / 'bench-0.sock'}", timeout=60)
        direct = docker.DockerClient(base_url=engine, timeout=60)
        try:
            results = side_by_side(proxied, direct, args.image, args.rounds)
            each = one_at_a_time(direct, args.image, args.reference) if args.reference else float("nan")
        finally:
            proxied.close()
            direct.close()
            atroposd("stop", "-c", str(cfg))
        stop_dir = root / "stop"
        stop_dir.mkdir()
        stopped = stop_time(stop_dir, engine, args.image, args.containers, podman)
    finally:
        if podman is not None:
            podman.stop()
        shutil.rmtree(root, ignore_errors=True)
    rows = []
    report: dict[str, Any] = {"bench": "sandbox", "rounds": args.rounds, "engine": "podman" if podman else engine}
    for what, label in (("lifecycle", "create-start-wait-remove"), ("exec", "exec round trip")):
        a, e = summary(results[what]["atroposd"]), summary(results[what]["engine"])
        ratio = a["median_ms"] / e["median_ms"]
        rows.append((label, e["median_ms"], a["median_ms"], ratio, e["p90_ms"], a["p90_ms"]))
        report[what] = {"engine": e, "atroposd": a, "ratio": ratio}
    report["stop"] = {"containers": args.containers, **stopped, "engine_one_at_a_time_s_each": each}
    print(f"{'':<26} {'engine ms':>10} {'atroposd ms':>12} {'ratio':>6} {'p90 engine':>11} {'p90 atroposd':>13}")
    for label, e_ms, a_ms, ratio, e90, a90 in rows:
        print(f"{label:<26} {e_ms:>10.1f} {a_ms:>12.1f} {ratio:>6.2f} {e90:>11.1f} {a90:>13.1f}")
    print(
        f"atroposd stop with {args.containers} containers ignoring SIGTERM: {stopped['stop_s']:.2f} s "
        f"({int(stopped['left'])} left); the engine's forced removal one at a time: {each:.2f} s each, "
        f"{each * args.containers:.0f} s for {args.containers}"
    )
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
