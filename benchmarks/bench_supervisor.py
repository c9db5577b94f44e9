"""Supervisor start-to-ready and stop times, with real children.

For each case a job of N command environments (``ready = "started"``, ``start_seconds = 0``;
trainer, API and inference disabled, so only the supervisor is measured) is run in the
foreground with a real sd_notify socket:

* start-to-READY: from launching ``atroposd run`` to the READY=1 datagram (interpreter start,
  config, pidfile, control socket, N launches through the death-signal launcher);
* stop: from SIGTERM to the daemon's exit, every child gone;
* the same through the CLI: ``atroposd start`` and ``atroposd stop`` wall times.

Children: ``cooperative`` (exits on SIGTERM) and ``stubborn`` (ignores SIGTERM, leaves a
setsid grandchild: the stop escalates after the grace and must still end within
``stop_timeout``).  The bare floor — ``python -c pass`` — is shown for comparison.

Prints a table and one JSON line (``{"benchmark": "supervisor", ...}``).

    python benchmarks/bench_supervisor.py [--repeat 3] [--stop-timeout 2]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "tests" / "child_scripts"


def _toml(v: Any) -> str:
    return json.dumps(v)


def write_config(d: Path, kind: str, n: int, stop_timeout: float) -> Path:
    lines = [
        "[daemon]",
        f"runtime_dir = {_toml(str(d / 'run'))}",
        f"state_dir = {_toml(str(d / 'state'))}",
        f"stop_timeout = {stop_timeout}",
        'log_format = "json"',
        "",
        "[api]",
        "enabled = false",
        'url = "http://127.0.0.1:9"',
        "",
        "[inference]",
        "enabled = false",
        'url = "http://127.0.0.1:9"',
        "",
        "[trainer]",
        "enabled = false",
        "",
    ]
    script = {"cooperative": ["cooperative.py"], "stubborn": ["stubborn.py", str(d / "pids-{name}")]}[kind]
    for i in range(n):
        argv = [sys.executable, str(SCRIPTS / script[0]), *script[1:]]
        lines += [
            "[[env]]",
            f'name = "{kind}{i}"',
            f"command = {_toml(argv)}",
            'ready = "started"',
            "start_seconds = 0.0",
            "",
        ]
    path = d / "atroposd.toml"
    path.write_text("\n".join(lines))
    return path


def _children_settled(d: Path, kind: str, n: int) -> None:
    """Stubborn children ignore SIGTERM only once their handler is set: wait for their pidfiles."""
    deadline = time.monotonic() + 60
    while kind == "stubborn" and len(list(d.glob("pids-*"))) < n and time.monotonic() < deadline:
        time.sleep(0.02)


def foreground(cfg: Path, d: Path, kind: str, n: int) -> tuple[float, float]:
    """(start-to-READY, SIGTERM-to-exit) of one `atroposd run`."""
    notify = d / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(notify))
    sock.settimeout(60)
    env = dict(os.environ, NOTIFY_SOCKET=str(notify))
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "atroposd", "run", "-c", str(cfg)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        while b"READY=1" not in sock.recv(65536):
            pass
        ready = time.monotonic() - t0
        _children_settled(d, kind, n)
        t1 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
        stop = time.monotonic() - t1
        if code != 0:
            raise RuntimeError(f"atroposd run exited {code}")
        return ready, stop
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        sock.close()
        notify.unlink(missing_ok=True)


def cli(cfg: Path, d: Path, kind: str, n: int) -> tuple[float, float]:
    """(atroposd start, atroposd stop) wall times."""

    def run(*args: str) -> float:
        t0 = time.monotonic()
        r = subprocess.run(
            [sys.executable, "-m", "atroposd", *args, "-c", str(cfg)], capture_output=True, text=True, timeout=120
        )
        if r.returncode != 0:
            raise RuntimeError(f"atroposd {args[0]} exited {r.returncode}: {r.stderr}")
        return time.monotonic() - t0

    for f in d.glob("pids-*"):
        f.unlink()
    start = run("start")
    _children_settled(d, kind, n)
    return start, run("stop")


def floor() -> float:
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    return time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--stop-timeout", type=float, default=2.0)
    ap.add_argument("--sizes", default="1,8,32")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    rows: list[dict[str, Any]] = []
    for kind in ("cooperative", "stubborn"):
        for n in sizes if kind == "cooperative" else sizes[:2]:
            samples: dict[str, list[float]] = {"ready": [], "stop": [], "cli_start": [], "cli_stop": []}
            for _ in range(args.repeat):
                with tempfile.TemporaryDirectory(prefix="apd-bench-", dir="/tmp") as tmp:
                    d = Path(tmp)
                    cfg = write_config(d, kind, n, args.stop_timeout)
                    ready, stop = foreground(cfg, d, kind, n)
                    samples["ready"].append(ready)
                    samples["stop"].append(stop)
                    s, t = cli(cfg, d, kind, n)
                    samples["cli_start"].append(s)
                    samples["cli_stop"].append(t)
            rows.append({"children": kind, "n": n, **{k: round(statistics.median(v), 3) for k, v in samples.items()}})
    base = floor()
    print(f"{'children':<12} {'N':>3} {'run→READY s':>12} {'SIGTERM→exit s':>15} {'start s':>8} {'stop s':>8}")
    for r in rows:
        print(
            f"{r['children']:<12} {r['n']:>3} {r['ready']:>12.3f} {r['stop']:>15.3f} {r['cli_start']:>8.3f} "
            f"{r['cli_stop']:>8.3f}"
        )
    print(
        f"floor: python -c pass = {base:.3f}s; stop_timeout = {args.stop_timeout:g}s "
        f"(stubborn stops must stay within it plus the daemon's exit)"
    )
    print(
        json.dumps(
            {
                "benchmark": "supervisor",
                "stop_timeout": args.stop_timeout,
                "python_floor_s": round(base, 3),
                "rows": rows,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
