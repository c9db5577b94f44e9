"""The trainer's state (``status --json``'s ``trainer.state``: the value), one enum for the
loop that sets it while it trains and the service that sets it around the loop."""

from __future__ import annotations

import enum

__all__ = ["TrainerState"]


class TrainerState(str, enum.Enum):
    """``waiting`` (for the model, data, ranks: ``waiting_for``), ``training``,
    ``checkpointing``, then how the run ended; the stall watchdog shows ``stalled`` over it."""

    WAITING = "waiting"
    TRAINING = "training"
    CHECKPOINTING = "checkpointing"
    FINISHED = "finished"
    STOPPED = "stopped"
    FAILED = "failed"
    COLLAPSED = "collapsed"  # past [health] max_rollbacks (SPEC §2, §15)

    def __str__(self) -> str:
        return self.value
