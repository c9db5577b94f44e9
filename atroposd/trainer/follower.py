"""``atroposd trainer-rank``: trainer ranks 1..N-1 (SPEC §12.1), supervised children of the daemon.

A rank joins the process group through the daemon's store (``ATROPOSD_TRAINER_STORE`` =
host:port; the group generation and the store prefix come from the store itself, so every
(re)formed group uses a fresh prefix), loads and shards the same model as rank 0 (and the same
checkpoint), then does what rank 0 tells it, command by command (:mod:`.ranks`): a step's
passes, the optimizer step or its discard, a gather of weights for a sync, a checkpoint's
shards, stop. Any failure of the group (rank 0 gone, a collective failed or timed out) ends the
process with exit 1: the daemon restarts the whole group from the last complete checkpoint.
"""

from __future__ import annotations

import datetime
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from atroposd.exitcodes import Exit
from atroposd.logs import get_logger

if TYPE_CHECKING:
    from atroposd.config import Config

__all__ = ["SECRET_VAR", "STORE_VAR", "generation_key", "serve"]

log = get_logger("atroposd.trainer.rank")

STORE_VAR = "ATROPOSD_TRAINER_STORE"
# Test hook (tests/e2e/test_trainer_ranks.py): "join" makes a rank hang before it joins.
TEST_HANG_VAR = "ATROPOSD_TEST_RANK_HANG"
SECRET_VAR = "ATROPOSD_TRAINER_SECRET"


def generation_key(secret: str) -> str:
    """The store key holding the current group generation (set by the daemon before it starts ranks)."""
    return f"{secret}/generation"


def connect_store(address: str, timeout: float) -> Any:
    import torch.distributed as dist

    host, _, port = address.rpartition(":")
    return dist.TCPStore(host.strip("[]"), int(port), is_master=False,
                         timeout=datetime.timedelta(seconds=timeout), use_libuv=False)


def serve(cfg: Config, rank: int) -> int:
    """Join, load, then follow rank 0's commands until ``stop``."""
    import torch

    from atroposd.trainer.ranks import GroupRanks, gather_full, store_keys
    from atroposd.trainer.setup import build_learner, load_for_training

    address, secret = os.environ.get(STORE_VAR, ""), os.environ.get(SECRET_VAR, "")
    if not address or not secret:
        log.error(f"{STORE_VAR} and {SECRET_VAR} must be set (the daemon starts this process)")
        return Exit.USAGE
    t = cfg.trainer
    if not 0 < rank < t.ranks:
        log.error("rank out of range", rank=rank, ranks=t.ranks)
        return Exit.USAGE
    from atroposd.devices import resolve_torch

    local = rank % t.local_ranks
    # The daemon narrowed this rank's visible GPUs to its own and named its device (cuda:0).
    own = os.environ.get("ATROPOSD_DEVICE") or t.device_of(rank)
    device, _ = resolve_torch(own, cfg.inference.dtype, key=f"trainer.device[{local}]")
    if device.type == "cpu":
        torch.set_num_threads(1)
    if os.environ.get(TEST_HANG_VAR) == "join":  # test hook: a rank that never joins
        log.warning("test hook: this rank never joins", rank=rank)
        threading.Event().wait()
    store = connect_store(address, t.join_timeout)
    generation = int(store.get(generation_key(secret)))
    ranks = GroupRanks.join(store, prefix=store_keys(secret, generation), rank=rank, world=t.ranks,
                            device=device, join_timeout=t.join_timeout, collective_timeout=t.collective_timeout)
    feed = None
    try:
        setup = load_for_training(cfg, ranks)
        learner = build_learner(cfg, setup)
        checkpointer = setup.checkpointer(learner)
        model = setup.policy.model
        from atroposd.paths import Paths
        from atroposd.weights.node_feed import NodeFeed

        # The first rank of a node other than the head feeds that node's replicas (SPEC §12.3).
        feed = NodeFeed.from_environ(Paths.of(cfg).weights_dir, setup.tensor_specs, setup.tied,
                                     t.sync_bucket_mb << 20)
        log.info("trainer rank ready", rank=rank, generation=generation, step=setup.step,
                 feeds_replicas=len(feed.sync.replicas) if feed is not None else 0)
        while True:
            op, arg = ranks.receive()
            if op == "compute":
                learner.compute_share(ranks.receive_share())
            elif op == "apply":
                learner.apply_local()
            elif op == "discard":
                learner.discard_local()
            elif op == "gather":
                names, push = (arg["names"], arg.get("push")) if isinstance(arg, dict) else (arg, None)
                tensors = gather_full(model, names)
                if feed is not None and push is not None:
                    feed.bucket(names, tensors, index=push["index"], count=push["count"], version=push["version"])
                del tensors
            elif op == "reload":
                if feed is not None:
                    feed.load(Path(arg["path"]), int(arg["version"]))
            elif op == "checkpoint":
                checkpointer.write_shards(Path(arg))
            elif op == "stop":
                log.info("trainer rank stops", rank=rank)
                return Exit.OK
            else:
                log.error("unknown command from rank 0", op=op)
                return Exit.RUNTIME
    finally:
        if feed is not None:
            feed.close()
        ranks.close()
