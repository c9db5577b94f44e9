"""One side of the cluster endpoint in its own process, as a daemon would run it.

argv: ROLE HEAD PORT TOKEN_FILE NODES NODE_RANK HEARTBEAT_TIMEOUT JOIN_TIMEOUT [--child]

ROLE ``head``: opens the endpoint, prints ``{"event": "listening"}`` and serves until SIGTERM.
ROLE ``node``: joins, reports one ready inference component and runs. With ``--child`` it
first starts a ``sleep`` child (its pid printed) that it kills when the job ends for it, as
the daemon stops its children. Exit codes as the daemon's: 0 after the head's stop, 1 when
the head is lost or does not answer within the join timeout, 2 when refused. Events go to
stdout as JSON lines; logs to stderr.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time

from atroposd.cluster import ClusterHead, ClusterJoinTimeout, ClusterNode, ClusterRefused
from atroposd.config import ClusterConfig
from atroposd.logs import configure_logging


def event(name: str, **fields: object) -> None:
    print(json.dumps({"event": name, **fields}), flush=True)


async def head(cfg: ClusterConfig, token: bytes) -> int:
    h = ClusterHead(cfg, token=token, host="head-host")
    await h.start()
    h.report([{"name": "inference", "kind": "inference", "state": "ready"}])
    event("listening", port=h.port)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await h.close()
    return 0


async def node(cfg: ClusterConfig, token: bytes, rank: int, child: subprocess.Popen[bytes] | None) -> int:

    def stop_children() -> None:
        if child is not None and child.poll() is None:
            child.kill()
            child.wait()

    async def on_stop() -> None:
        stop_children()
        event("stopping")

    def on_lost_head(reason: str) -> None:
        stop_children()
        event("lost", reason=reason, at=time.time(), stop_by_in=n.stop_by - time.monotonic())

    n = ClusterNode(
        cfg,
        token=token,
        node_rank=rank,
        host=f"node-{rank}",
        units={"trainer_ranks": 1},
        on_stop=on_stop,
        on_lost_head=on_lost_head,
    )
    try:
        await n.join()
    except ClusterRefused as exc:
        stop_children()
        event("refused", reason=str(exc))
        return 2
    except ClusterJoinTimeout as exc:
        stop_children()
        event("join-timeout", reason=str(exc))
        return 1
    event("joined")
    n.report([{"name": "inference", "kind": "inference", "state": "ready", "pid": child.pid if child else None}])
    outcome = await n.run()
    event("outcome", outcome=outcome)
    return 0 if outcome == "stopped" else 1


def main() -> int:
    role, head_host, port, token_file, nodes, rank, hb, join = sys.argv[1:9]
    configure_logging("info", "json")
    cfg = ClusterConfig(
        nodes=int(nodes),
        node_rank=int(rank),
        head=head_host,
        port=int(port),
        token_file=token_file,
        heartbeat_timeout=float(hb),
        join_timeout=float(join),
    )
    token = cfg.read_token()
    if role == "head":
        return asyncio.run(head(cfg, token))
    child = subprocess.Popen(["sleep", "300"]) if "--child" in sys.argv[9:] else None
    if child is not None:
        event("child", pid=child.pid)
    return asyncio.run(node(cfg, token, int(rank), child))


if __name__ == "__main__":
    sys.exit(main())
