"""Rank 0 of a trainer group, outside the daemon, for the rank tests: it hosts the store, starts
the real ``atroposd trainer-rank`` children, and trains seeded batches exactly as the loop does
(learner.compute → apply, or learner.train with several optimizer steps per batch; checkpoints
through the Checkpointer), then writes what it saw.

    python -m tests.trainer.rank_zero CONFIG OUT [--steps K] [--checkpoint-at C] [--first-batch B]
        [--attack MARKER] [--background] [--final]

``--background``: the checkpoint at C is written in the background (as the loop writes a periodic
one) while the next steps train; ``--final``: after the last step, a checkpoint with the Hugging
Face layout (as the loop writes at the last step).

With ``--attack``, before it tells the other ranks to stop, a separate client that holds only
the store's address (``tests.trainer.store_client``) writes what it likes at the next command's
key: a pickle that would create MARKER, a JSON command without the key, a replayed command.

OUT (torch.save): {"losses": [...], "grad_norms": [...], "params": {name: full tensor},
"step": last step, "resumed_from": step or None, "follower_codes": [exit code of each rank],
"checkpoint_params": {name: full tensor} at C, "loaded_params": the same as loaded (before the steps), "in_flight":
[steps trained while C's write was in flight]}. Batch i is ``make_groups(1000 + i, n=4)``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from atroposd.clargs import load_or_exit
from atroposd.trainer.batch import prepare_batch
from atroposd.trainer.follower import KEY_VAR, SECRET_VAR, STORE_VAR
from atroposd.trainer.fsdp import gather_full
from atroposd.trainer.group import Gather, Stop
from atroposd.trainer.ranks import GroupRanks, OneRank, Ranks
from atroposd.trainer.setup import build_learner, load_for_training
from tests.trainer.conftest import make_groups


def full_params(model: torch.nn.Module, ranks: Ranks) -> dict[str, torch.Tensor]:
    names = [n for n in model.state_dict()]
    if ranks.world > 1:
        ranks.command(Gather(tuple(names)))
        return gather_full(model, names)
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--checkpoint-at", type=int, default=0)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--attack", default="")
    ap.add_argument("--background", action="store_true")
    ap.add_argument("--final", action="store_true")
    args = ap.parse_args()
    ns = argparse.Namespace(config=args.config)
    cfg = load_or_exit(ns)
    t = cfg.trainer
    world = t.ranks
    torch.set_num_threads(1)
    followers: list[subprocess.Popen[bytes]] = []
    store = None
    ranks: Ranks
    if world > 1:
        from atroposd.trainer.group import GroupStore

        store = GroupStore(secret="test-secret", world=world)
        prefix = store.next_generation()
        env = {**os.environ, STORE_VAR: store.address, SECRET_VAR: "test-secret", KEY_VAR: store.key.hex()}
        for r in range(1, world):
            log = open(Path(args.out).with_suffix(f".rank{r}.log"), "ab")
            followers.append(
                subprocess.Popen(
                    [sys.executable, "-m", "atroposd", "trainer-rank", "-c", args.config, "--rank", str(r)],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        ranks = GroupRanks.join(
            store.store,
            prefix=prefix,
            key=store.key,
            rank=0,
            world=world,
            device=torch.device("cpu"),
            join_timeout=t.join_timeout,
            collective_timeout=t.collective_timeout,
            commands=store.commands(),
        )
    else:
        ranks = OneRank()
    try:
        setup = load_for_training(cfg, ranks)
        learner = build_learner(cfg, setup)
        checkpointer = setup.checkpointer(learner)
        step = setup.step
        out: dict[str, Any] = {
            "losses": [],
            "grad_norms": [],
            "resumed_from": step if setup.restored else None,
            "in_flight": [],
            "loaded_params": full_params(learner.policy.model, ranks),
        }
        writing = None
        for _ in range(args.steps):
            batch = prepare_batch(
                make_groups(1000 + step, n=args.groups),
                micro_batch_size=t.micro_batch_size,
                micro_batch_tokens=t.micro_batch_tokens,
                max_token_len=t.max_token_len,
                adv_std_floor=t.adv_std_floor,
                vocab_size=learner.policy.vocab_size,
                advantage=t.advantage,
                overlong=t.overlong,
                keep_rows=learner.steps_per_batch > 1,
            )
            if learner.steps_per_batch > 1:  # several optimizer steps on the batch (SPEC §14)
                result = learner.train(batch, step + 1)
            else:
                result = learner.compute(batch)
                assert result.finite, result
                learner.apply()
            assert result.finite, result
            step += 1
            out["losses"].append(result.loss)
            out["grad_norms"].append(result.grad_norm)
            if writing is not None and not writing.done():
                out["in_flight"].append(step)
            if step == args.checkpoint_at:
                writing = checkpointer.start(step, step, 0, background=args.background)
                out["checkpoint_params"] = full_params(learner.policy.model, ranks)
        if writing is not None:
            writing.result()  # raises what the write raised
        if args.final:
            checkpointer.save(step, step, 0, consolidate=True)
        out["params"] = full_params(learner.policy.model, ranks)
        out["step"] = step
        if args.attack and store is not None:
            subprocess.run(
                [sys.executable, "-m", "tests.trainer.store_client", store.address, args.attack],
                env={k: v for k, v in os.environ.items() if k != KEY_VAR},
                check=True,
                timeout=60,
            )
        ranks.command(Stop())
    finally:
        for p in followers:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        ranks.close()
        if store is not None:
            store.close()
    out["follower_codes"] = [p.returncode for p in followers]
    torch.save(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
