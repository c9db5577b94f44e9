"""``atroposd trainer-rank``: trainer ranks 1..N-1 (SPEC §12.1), supervised children of the daemon.

A rank joins the process group through the daemon's store (``ATROPOSD_TRAINER_STORE``: the path of
its file on one machine, host:port with several; the group generation and the store prefix come from
the store itself, so every (re)formed group uses a fresh prefix), loads and shards the same model as
rank 0 (and the same checkpoint), then does what rank 0 tells it, command by command: typed, MACed
commands (:mod:`.group`) looked up in one dispatch table (``Follower``): a step's passes, the
optimizer step or its discard, a gather of weights for a sync, a checkpoint's shards, the sentinel's
canary scoring, stop. The group's key comes from the daemon in this process's environment
(``ATROPOSD_TRAINER_KEY``); a store value that is not rank 0's is never run (the rank ends; the
daemon restarts the group). Any failure of the group (rank 0 gone, a collective failed or timed out)
ends the process with exit 1: the daemon restarts the whole group from the last complete checkpoint.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from atroposd.exitcodes import Exit
from atroposd.logs import get_logger
from atroposd.trainer.group import (
    KEY_VAR,
    Apply,
    BadCommand,
    Canary,
    Checkpoint,
    Command,
    Compute,
    Discard,
    Gather,
    Reload,
    Score,
    Stop,
    command_box,
    connect_store,
    generation_key,
    key_from_env,
    store_keys,
)

if TYPE_CHECKING:
    import torch

    from atroposd.config import Config
    from atroposd.trainer.learner import Learner
    from atroposd.trainer.ranks import GroupRanks
    from atroposd.trainer.setup import Checkpointer
    from atroposd.weights.node_feed import NodeFeed

__all__ = ["KEY_VAR", "SECRET_VAR", "STORE_VAR", "Follower", "generation_key", "serve"]

log = get_logger("atroposd.trainer.rank")

STORE_VAR = "ATROPOSD_TRAINER_STORE"
SECRET_VAR = "ATROPOSD_TRAINER_SECRET"
# At its end a rank waits this long for its checkpoint shards still being written.
SHARDS_FINISH_S = 60.0


@dataclass
class Follower:
    """What a follower rank does for each of rank 0's commands: one handler per command type
    (``HANDLERS``); a handler returns an exit code to end the rank, or None to go on."""

    ranks: GroupRanks
    learner: Learner
    checkpointer: Checkpointer
    model: torch.nn.Module
    feed: NodeFeed | None = None  # this node's replicas, fed by its first rank

    def compute(self, cmd: Compute) -> int | None:
        self.learner.compute_share(self.ranks.receive_share(), capture=cmd.capture)
        return None

    def score(self, cmd: Score) -> int | None:
        self.learner.score_share(self.ranks.receive_share(), cmd.size)
        return None

    def apply(self, cmd: Apply) -> int | None:
        self.learner.apply_local()
        return None

    def discard(self, cmd: Discard) -> int | None:
        self.learner.discard_local()
        return None

    def gather(self, cmd: Gather) -> int | None:
        from atroposd.trainer.fsdp import gather_full

        tensors = gather_full(self.model, list(cmd.names))
        if self.feed is not None and cmd.push is not None:
            p = cmd.push
            self.feed.bucket(list(cmd.names), tensors, index=p.index, count=p.count, version=p.version)
        del tensors
        return None

    def reload(self, cmd: Reload) -> int | None:
        if self.feed is not None:
            self.feed.load(Path(cmd.path), cmd.version)
        return None

    def checkpoint(self, cmd: Checkpoint) -> int | None:
        self.checkpointer.write_shards(Path(cmd.path), background=cmd.background)
        return None

    def canary(self, cmd: Canary) -> int | None:
        from atroposd.trainer.sentinel import follow_canary

        follow_canary(self.ranks, self.model, self.learner.policy.vocab_size)
        return None

    def stop(self, cmd: Stop) -> int | None:
        log.info("trainer rank stops", rank=self.ranks.rank)
        return int(Exit.OK)

    HANDLERS: ClassVar[dict[type[Any], Callable[[Follower, Any], int | None]]] = {
        Compute: compute,
        Score: score,
        Apply: apply,
        Discard: discard,
        Gather: gather,
        Reload: reload,
        Checkpoint: checkpoint,
        Canary: canary,
        Stop: stop,
    }

    def run(self, cmd: Command) -> int | None:
        return self.HANDLERS[type(cmd)](self, cmd)

    def follow(self) -> int:
        """Receive and run commands until one ends the rank (``stop``: 0)."""
        while True:
            code = self.run(self.ranks.receive())
            if code is not None:
                return code


def serve(cfg: Config, rank: int) -> int:
    """Join, load, then follow rank 0's commands until ``stop``."""
    import torch

    from atroposd.trainer.ranks import GroupRanks
    from atroposd.trainer.setup import build_learner, load_for_training

    address, secret = os.environ.get(STORE_VAR, ""), os.environ.get(SECRET_VAR, "")
    if not address or not secret:
        log.error(f"{STORE_VAR} and {SECRET_VAR} must be set (the daemon starts this process)")
        return Exit.USAGE
    try:
        key = key_from_env(os.environ)
    except ValueError as exc:
        log.error(f"{exc} (the daemon starts this process)")
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
    store = connect_store(address, t.join_timeout)
    generation = int(store.get(generation_key(secret)))
    ranks = GroupRanks.join(
        store,
        prefix=store_keys(secret, generation),
        key=key,
        rank=rank,
        world=t.ranks,
        device=device,
        join_timeout=t.join_timeout,
        collective_timeout=t.collective_timeout,
        commands=command_box(address),
    )
    feed = None
    checkpointer: Checkpointer | None = None
    try:
        setup = load_for_training(cfg, ranks)
        learner = build_learner(cfg, setup)
        checkpointer = setup.checkpointer(learner)
        from atroposd.paths import Paths
        from atroposd.weights.node_feed import NodeFeed

        # The first rank of a node other than the head feeds that node's replicas (SPEC §12.3).
        feed = NodeFeed.from_environ(Paths.of(cfg).weights_dir, setup.tensor_specs, setup.tied, t.sync_bucket_mb << 20)
        if feed is not None:  # in-flight updates (SPEC §7): this node's replicas paused as the head's are
            from atroposd.weights.replicas import pause_request

            feed.sync.replicas.pause_body = pause_request(t.inflight, t.inflight_kv)
        log.info(
            "trainer rank ready",
            rank=rank,
            generation=generation,
            step=setup.step,
            feeds_replicas=len(feed.sync.replicas) if feed is not None else 0,
        )
        try:
            return Follower(ranks, learner, checkpointer, setup.policy.model, feed).follow()
        except BadCommand as exc:
            log.error(
                "refused rank 0's next command: not a command of this group; this rank ends "
                "(the daemon restarts the group)",
                rank=rank,
                error=str(exc),
                refused=ranks.refused,
            )
            return Exit.RUNTIME
    finally:
        if checkpointer is not None:  # this rank's shards still being written finish first
            checkpointer.wait_previous(timeout=SHARDS_FINISH_S)
        if feed is not None:
            feed.close()
        ranks.close()
