"""The store in-process: room is granted first come first served, a cancelled or timed-out wait
gives its claim back, held sequences are counted exactly, a reset forgets a batch in flight."""

from __future__ import annotations

import asyncio

import pytest

from atroposd.api.queue import QueueFull, TrajectoryStore
from atroposd.api.schema import Group, TrainerRegistration, group_from_json
from tests.api.conftest import group


def g(n: int, tag: float = 0.0, env_id: int | None = None) -> Group:
    return group_from_json(group(n, tag=tag, env_id=env_id))


def registered(capacity: int, batch_size: int = 4) -> TrajectoryStore:
    store = TrajectoryStore(capacity)
    store.register(TrainerRegistration("", "", batch_size, 64, "c", 1, 0, 10))
    return store


async def put(store: TrajectoryStore, *groups: Group, wait: float = 0.0) -> None:
    await store.reserve(sum(x.n for x in groups), wait)
    store.submit(list(groups))


def test_room_is_granted_in_arrival_order() -> None:
    async def main() -> list[str]:
        store = registered(capacity=8)
        await put(store, g(4, 1.0), g(4, 2.0))
        order: list[str] = []

        async def waiter(name: str, n: int) -> None:
            await put(store, g(n, 9.0), wait=10)
            order.append(name)

        big = asyncio.create_task(waiter("big", 4))
        await asyncio.sleep(0.01)
        small = asyncio.create_task(waiter("small", 2))  # fits earlier, but arrived later
        await asyncio.sleep(0.01)
        assert store.waiting == 2
        batch = store.take_batch()
        assert batch is not None
        store.delivered(batch, store.epoch)  # frees 4: "big" goes first, "small" still waits
        await asyncio.sleep(0.01)
        assert order == ["big"] and store.held == 8 and store.waiting == 1  # 4 formed + 4 big
        small.cancel()
        await asyncio.gather(big, small, return_exceptions=True)
        return order

    assert asyncio.run(main()) == ["big"]


def test_timeout_and_cancel_give_the_claim_back() -> None:
    async def main() -> None:
        store = registered(capacity=4)
        await put(store, g(4))
        with pytest.raises(QueueFull, match="no room within"):
            await put(store, g(2), wait=0.05)
        task = asyncio.create_task(put(store, g(2), wait=10))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert store.waiting == 0
        with pytest.raises(QueueFull) as too_big:
            await store.reserve(5, 10)
        assert too_big.value.too_large
        batch = store.take_batch()
        assert batch is not None
        store.delivered(batch, store.epoch)
        await put(store, g(4))  # all room is back: nothing leaked from the failed waits
        assert store.held == 4

    asyncio.run(main())


def test_held_counts_queue_buffers_and_formed_batches() -> None:
    async def main() -> None:
        store = registered(capacity=64, batch_size=4)
        store.started = True
        env = store.register_env(
            {"max_token_length": 64, "desired_name": "e", "weight": 1.0, "group_size": 4, "min_batch_allocation": None}
        )["env_id"]
        await put(store, g(4, 1.0, env), g(4, 2.0, env), g(4, 3.0, env), g(1, 4.0, env))
        assert store.held == 13 and store.status()["buffered_sequences"] == 1
        first = store.take_batch()  # forms three, serves one
        assert first is not None and len(store.formed) == 2 and store.held == 13
        store.undeliver(first, store.epoch)
        assert store.take_batch() is first  # a failed write: the same batch next
        store.delivered(first, store.epoch)
        assert store.held == 9 and store.step == 3

    asyncio.run(main())


def test_reset_forgets_a_batch_in_flight() -> None:
    async def main() -> None:
        store = registered(capacity=16)
        await put(store, g(4, 1.0))
        epoch = store.epoch
        batch = store.take_batch()
        assert batch is not None
        store.reset()
        store.delivered(batch, epoch)
        store.undeliver(batch, epoch)
        assert store.held == 0 and store.formed == [] and store.served_step == 0

    asyncio.run(main())
