"""A trainer process for the checkpoint tests (run as a real subprocess, then killed).

usage: child_trainer.py STATE_DIR MODEL_DIR STEPS MODE
  MODE "uninterrupted": train STEPS steps, checkpoint, train step STEPS+1, print its loss and
                        a hash of the weights, then wait to be killed.
  MODE "kill-mid-write": train STEPS steps, checkpoint, train one more step, start its
                        checkpoint and stop in the middle of writing it (a marker file says
                        so), waiting to be killed.
"""

from __future__ import annotations

import hashlib
import sys
import threading
from pathlib import Path

import orjson
import torch

from atroposd.logs import configure_logging
from atroposd.trainer import checkpoint as ckpt_mod
from atroposd.trainer.batch import prepare_batch
from atroposd.trainer.loop import Progress
from atroposd.trainer.setup import build_learner, load_for_training
from tests.trainer.conftest import make_cfg, make_groups


def weights_hash(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def batch_for(step: int, cfg: object) -> object:
    t = cfg.trainer  # type: ignore[attr-defined]
    return prepare_batch(
        make_groups(100 + step), micro_batch_size=t.micro_batch_size, max_token_len=64, adv_std_floor=0.1
    )


def train_step(learner: object, progress: Progress, cfg: object) -> float:
    result = learner.compute(batch_for(progress.step + 1, cfg))  # type: ignore[attr-defined]
    learner.apply()  # type: ignore[attr-defined]
    progress.step += 1
    progress.weight_version += 1
    return float(result.loss)


def main() -> None:
    state_dir, model_dir, steps, mode = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    torch.set_num_threads(1)
    configure_logging("warning", "json", stream=sys.stderr)  # stdout carries only the result line
    cfg = make_cfg(state_dir, model_dir, lr=3e-3, kl_coef=0.04, kl_reference="initial")
    setup = load_for_training(cfg)
    learner = build_learner(cfg, setup)
    progress = Progress(total_steps=100, step=setup.step, weight_version=setup.weight_version)
    checkpointer = setup.checkpointer(learner)
    while progress.step < steps:
        train_step(learner, progress, cfg)
    checkpointer.save(progress.step, progress.weight_version, progress.skipped_steps)
    loss = train_step(learner, progress, cfg)
    if mode == "kill-mid-write":
        real_save = torch.save

        def stuck_save(obj: object, path: object, *a: object, **kw: object) -> None:
            real_save(obj, path, *a, **kw)  # type: ignore[arg-type]
            (state_dir / "mid-write").write_text(str(path))
            threading.Event().wait()  # killed here, with the temporary directory half done

        ckpt_mod.torch.save = stuck_save  # type: ignore[assignment]
        checkpointer.save(progress.step, progress.weight_version, progress.skipped_steps)
    print(orjson.dumps({"loss": loss, "hash": weights_hash(learner.policy.model)}).decode(), flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
