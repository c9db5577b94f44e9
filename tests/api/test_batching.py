"""Batch formation equals atroposlib's (``api/utils.py``) on random queues, and a few hand-made
cases that pin the packing rules down without atroposlib."""

from __future__ import annotations

import random

import pytest

from atroposd.api.batching import find_groups_summing_to_target, grab_exact, grab_with_minimums


def test_exact_batches_by_hand() -> None:
    assert grab_exact([], 8) is None
    assert grab_exact([4, 2], 8) is None  # not enough sequences
    assert grab_exact([4, 2, 2], 8) == [0, 1, 2]
    # packs of the largest size (4) complete in queue order; smaller groups wait for a full pack
    assert grab_exact([2, 4, 1, 1, 4, 2], 8) == [1, 4]  # two 1s are half a pack of 4
    assert grab_exact([16, 8], 8) is None  # a group larger than the batch never fits
    assert grab_exact([3, 4, 4], 8) == [1, 2]  # 3 does not divide 4: it stays


def test_buffer_subset_by_hand() -> None:
    assert find_groups_summing_to_target([2, 1, 1], 4) == [0, 1, 2]
    assert find_groups_summing_to_target([3, 2, 2], 4) == [1, 2]  # FIFO fails, subset-sum finds it
    assert find_groups_summing_to_target([3, 3], 4) == []


def test_minimum_allocations_by_hand() -> None:
    # env 0 needs half the batch but has nothing: no batch
    assert grab_with_minimums([2, 2, 2, 2], [1, 1, 1, 1], 8, {0: 0.5}) is None
    picked = grab_with_minimums([2, 2, 2, 2, 2, 2], [1, 1, 1, 0, 0, 1], 8, {0: 0.5})
    assert picked is not None and sorted(picked) == [0, 1, 3, 4]
    assert picked[:2] == [3, 4]  # the minimum is served first


upstream = pytest.importorskip("atroposlib.api.utils", reason="atroposlib not installed")


@pytest.mark.atroposlib
@pytest.mark.parametrize("seed", range(0, 400, 50))
def test_grab_exact_equals_upstream(seed: int) -> None:
    for k in range(seed, seed + 50):
        _exact_case(random.Random(k))


def _exact_case(rng: random.Random) -> None:
    batch_size = rng.choice([4, 8, 16, 32])
    sizes = [rng.choice([1, 2, 4, 8]) for _ in range(rng.randrange(0, 40))]
    queue = [{"tokens": [[0]] * n, "i": i} for i, n in enumerate(sizes)]
    while True:
        batch, queue_after = upstream.grab_exact_from_heterogeneous_queue(queue, batch_size)
        ours = grab_exact([len(q["tokens"]) for q in queue], batch_size)
        if batch is None:
            assert ours is None
            return
        assert ours is not None
        assert [queue[i]["i"] for i in ours] == [g["i"] for g in batch]
        queue = queue_after


@pytest.mark.atroposlib
@pytest.mark.parametrize("seed", range(0, 400, 50))
def test_minimum_allocations_equal_upstream(seed: int) -> None:
    for k in range(seed, seed + 50):
        _minimums_case(random.Random(1000 + k))


def _minimums_case(rng: random.Random) -> None:
    batch_size = rng.choice([8, 16, 32])
    n_envs = rng.randrange(1, 4)
    envs = [
        {
            "registered_id": e,
            "connected": rng.random() > 0.2,
            "min_batch_allocation": rng.choice([None, 0.1, 0.25, 0.5, 0.7]),
        }
        for e in range(n_envs)
    ]
    sizes = [rng.choice([1, 2, 4]) for _ in range(rng.randrange(0, 40))]
    env_ids = [rng.choice([*range(n_envs), None]) for _ in sizes]
    queue = [{"tokens": [[0]] * n, "env_id": e, "i": i} for i, (n, e) in enumerate(zip(sizes, env_ids, strict=True))]
    minimums = {
        e["registered_id"]: e["min_batch_allocation"]
        for e in envs
        if e["connected"] and e["min_batch_allocation"] is not None
    }
    while True:
        batch, queue_after = upstream.grab_batch_with_minimum_allocations(queue, batch_size, envs)
        ours = grab_with_minimums([len(q["tokens"]) for q in queue], [q["env_id"] for q in queue], batch_size, minimums)
        if batch is None:
            assert ours is None
            return
        assert ours is not None
        assert [queue[i]["i"] for i in ours] == [g["i"] for g in batch]
        queue = queue_after


@pytest.mark.atroposlib
def test_buffer_subsets_equal_upstream() -> None:
    for k in range(300):
        _subset_case(random.Random(2000 + k))


def _subset_case(rng: random.Random) -> None:
    target = rng.choice([4, 8, 16])
    sizes = [rng.randrange(1, target) for _ in range(rng.randrange(0, 12))]
    expected = upstream.find_groups_summing_to_target([{"tokens": [[0]] * n} for n in sizes], target)
    assert find_groups_summing_to_target(sizes, target) == expected
