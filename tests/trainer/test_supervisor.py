"""The trainer group's supervisor (``trainer/supervisor.py``): its state machine and its loop
over typed faults, driven by a fleet stand-in that records what the supervisor asks of it and
feeds faults through the daemon's real fault stream (``daemon.ranks.FaultStream``)."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import anyio
import pytest

from atroposd.daemon.ranks import FaultStream
from atroposd.restarts import RestartBudget
from atroposd.trainer.compute import Fenced
from atroposd.trainer.state import TrainerState
from atroposd.trainer.supervisor import (
    TRANSITIONS,
    CollectiveFailed,
    Fault,
    GroupFault,
    GroupState,
    GroupSupervisor,
    IllegalTransition,
    NodeLost,
    RankExited,
)

pytestmark = pytest.mark.anyio


def stopped() -> TrainerState:
    return TrainerState.STOPPED


class StandFleet:
    """What the supervisor asks of the daemon's fleet, recorded; faults through a real stream."""

    def __init__(self, missing: list[int] | None = None) -> None:
        self.stream = FaultStream()
        self.calls: list[str] = []
        self.generation = 0
        self.nodes_missing = missing or []

    @property
    def store(self) -> object:
        raise AssertionError("the supervisor never reads the store")

    async def start(self) -> str:
        self.generation += 1
        self.calls.append(f"start {self.generation}")
        return f"g{self.generation}/"

    async def stop(self) -> None:
        self.calls.append("stop")

    async def ready(self, on_wait: Callable[[list[int]], None]) -> None:
        self.calls.append("ready")

    def missing(self) -> list[int]:
        return list(self.nodes_missing)

    def faults(self) -> FaultStream:
        return self.stream


def supervisor(fleet: StandFleet, *, max_restarts: int = 3) -> GroupSupervisor:
    return GroupSupervisor(
        fleet,  # type: ignore[arg-type]  # the stand-in's store is never read
        budget=RestartBudget(max_restarts, 60.0, first=0.01, cap=0.02),
        restart_window=60.0,
    )


# ---------------------------------------------------------------------------- the state machine


def test_every_state_has_its_transitions_and_stopped_is_final() -> None:
    assert set(TRANSITIONS) == set(GroupState)
    assert TRANSITIONS[GroupState.STOPPED] == frozenset()
    assert all(GroupState.STOPPED in TRANSITIONS[s] for s in GroupState if s != GroupState.STOPPED)


@pytest.mark.parametrize(
    ("old", "new"), [(a, b) for a, b in itertools.product(GroupState, GroupState) if b not in TRANSITIONS[a]]
)
def test_an_illegal_transition_raises_and_leaves_the_state(old: GroupState, new: GroupState) -> None:
    group = GroupSupervisor(None, budget=RestartBudget(1, 60.0), restart_window=60.0)
    group.state = old
    with pytest.raises(IllegalTransition, match=f"{old.value} → {new.value}"):
        group.move(new, "a test")
    assert group.state == old


def test_the_legal_path_of_a_fault_and_a_restart() -> None:
    seen: list[GroupState] = []
    group = GroupSupervisor(None, budget=RestartBudget(1, 60.0), restart_window=60.0, on_move=seen.append)
    for state in (GroupState.TRAINING, GroupState.FAULTED, GroupState.BACKOFF, GroupState.FORMING):
        group.move(state)
    group.move(GroupState.TRAINING)
    group.move(GroupState.FORMING, "a rollback")
    group.move(GroupState.STOPPED)
    assert seen == [
        GroupState.TRAINING,
        GroupState.FAULTED,
        GroupState.BACKOFF,
        GroupState.FORMING,
        GroupState.TRAINING,
        GroupState.FORMING,
        GroupState.STOPPED,
    ]


def test_faults_read_as_the_status_names_them() -> None:
    assert str(RankExited("trainer-1", "killed by SIGKILL")) == "trainer-1 killed by SIGKILL"
    assert str(RankExited("trainer-3", "exited with code 1", node=1)) == "trainer-3 on node 1 exited with code 1"
    assert str(NodeLost(2, "left: stopped on its own")) == "node 2 lost (left: stopped on its own)"
    assert str(CollectiveFailed("DistError: gone")) == "a collective failed: DistError: gone"


# ---------------------------------------------------------------------------- the loop over faults


async def test_a_rank_exit_on_the_fleets_stream_restarts_the_group() -> None:
    fleet = StandFleet()
    group = supervisor(fleet)
    attempts: list[str] = []

    async def attempt(prefix: str | None) -> TrainerState:
        assert prefix is not None  # the supervisor started the generation's ranks before
        attempts.append(prefix)
        group.move(GroupState.TRAINING)
        if len(attempts) == 2:
            return TrainerState.FINISHED
        with group.training():
            fleet.stream.put(RankExited("trainer-1", "killed by SIGKILL", node=1))  # node 1's rank died
            await anyio.sleep(5)  # training, until the monitor reads the fault and cancels it
            raise AssertionError("the fault cancels the training")
        group.check()  # the generation ends with its fault
        raise AssertionError("check() raises the fault")

    async def halt() -> None:
        fleet.calls.append("halt")

    async def collapsed(collapse: object) -> None:
        raise AssertionError("no collapse here")

    with anyio.fail_after(10):
        outcome = await group.run(
            attempt, started=lambda: True, halt=halt, collapsed=collapsed, stopped=lambda: TrainerState.STOPPED
        )
    assert outcome == TrainerState.FINISHED
    assert attempts == ["g1/", "g2/"]  # the next generation's ranks were started
    # the supervisor stops the fleet's ranks itself, then rank 0's part halts
    assert fleet.calls == ["ready", "start 1", "stop", "halt", "ready", "start 2"]
    assert (group.restarts, group.last_fault) == (1, "trainer-1 on node 1 killed by SIGKILL")
    assert group.state == GroupState.STOPPED and group.budget.count == 1


async def test_a_failed_collective_is_named_by_the_rank_exit_that_follows_it() -> None:
    fleet = StandFleet(missing=[1])  # node 1 is lost: the restart is not counted
    group = supervisor(fleet)
    runs = 0

    async def attempt(prefix: str | None) -> TrainerState:
        nonlocal runs
        runs += 1
        group.move(GroupState.TRAINING)
        if runs == 2:
            return TrainerState.STOPPED
        fleet.stream.put(NodeLost(1, "connection closed"))  # seen after the collective broke
        raise Fenced("the group was re-formed")  # from the compute thread, before the monitor ran

    async def nothing(*args: object) -> None:
        pass

    with anyio.fail_after(10):
        await group.run(attempt, started=lambda: True, halt=nothing, collapsed=nothing, stopped=stopped)
    assert group.last_fault == "node 1 lost (connection closed): a collective failed: Fenced: the group was re-formed"
    assert group.restarts == 1 and group.budget.count == 0


async def test_past_max_restarts_the_group_stops_and_a_group_that_never_trained_fails_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from atroposd.trainer import supervisor as module

    monkeypatch.setattr(module, "RANK_EXIT_GRACE_S", 0.05)  # no rank exit names these failures
    fleet = StandFleet()
    group = supervisor(fleet, max_restarts=1)

    async def attempt(prefix: str | None) -> TrainerState:
        group.move(GroupState.TRAINING)
        raise RuntimeError("gloo: connection reset by peer")

    async def nothing(*args: object) -> None:
        pass

    with anyio.fail_after(10), pytest.raises(GroupFault, match=r"2 trainer group restarts within 60 s") as info:
        await group.run(attempt, started=lambda: True, halt=nothing, collapsed=nothing, stopped=stopped)
    assert isinstance(info.value.fault, CollectiveFailed) and "gloo" in info.value.fault.error
    assert group.state == GroupState.STOPPED and fleet.generation == 2

    fleet = StandFleet()
    group = supervisor(fleet)
    with anyio.fail_after(10), pytest.raises(GroupFault, match="a collective failed"):
        await group.run(attempt, started=lambda: False, halt=nothing, collapsed=nothing, stopped=stopped)
    assert group.state == GroupState.STOPPED and group.restarts == 0 and fleet.generation == 1


async def test_a_fault_while_stopping_or_of_one_rank_is_no_fault() -> None:
    fleet = StandFleet()
    group = supervisor(fleet)
    group.stopping = True
    trained = False
    with group.training():
        group.on_fault(RankExited("trainer-1", "exited with code 0"))
        await anyio.sleep(0.01)
        trained = True  # not cancelled
    assert trained and group.fault is None
    alone = GroupSupervisor(None, budget=RestartBudget(1, 60.0), restart_window=60.0)
    alone.on_fault(RankExited("trainer-1", "exited with code 1"))
    assert alone.fault is None and alone.as_fault(RuntimeError("gloo: gone")) is None


async def test_a_fault_seen_before_the_training_cancels_it_at_once() -> None:
    group = supervisor(StandFleet())
    group.on_fault(NodeLost(1, "connection closed"))  # while the generation was loading its model
    with anyio.fail_after(5), group.training():
        await anyio.sleep(5)
        raise AssertionError("a generation with a fault never trains")
    with pytest.raises(GroupFault, match=r"node 1 lost \(connection closed\)"):
        group.check()


async def test_the_faults_kept_to_name_are_the_last_64() -> None:
    fleet = StandFleet()
    group = supervisor(fleet)
    faults: list[Fault] = [RankExited(f"trainer-{i}", "exited with code 1", node=1) for i in range(100)]
    for f in faults:
        group.on_fault(f)
    assert group.fault == faults[0] and group.seen == faults[36:]


async def test_a_stop_while_the_group_waits_for_a_lost_node_ends_it_without_training() -> None:
    class WaitingFleet(StandFleet):
        async def ready(self, on_wait: Callable[[list[int]], None]) -> None:
            self.calls.append("ready")
            on_wait([1])
            await anyio.sleep(30)  # node 1 never comes back

    fleet = WaitingFleet(missing=[1])
    group = supervisor(fleet)
    waited: list[list[int]] = []

    async def attempt(prefix: str | None) -> TrainerState:
        raise AssertionError("no generation trains: none was started")

    async def nothing(*args: object) -> None:
        pass

    async def stop_soon() -> None:
        await anyio.sleep(0.2)
        group.stop()

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(stop_soon)
            outcome = await group.run(
                attempt, started=lambda: True, halt=nothing, collapsed=nothing, stopped=stopped, on_wait=waited.append
            )
    assert outcome == TrainerState.STOPPED and group.state == GroupState.STOPPED
    assert waited == [[], [1]] and fleet.calls == ["ready"] and group.stopping
