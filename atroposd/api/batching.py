"""Batch formation exactly as run-api does it (atroposlib ``api/utils.py``), on group sizes only.

The functions take the number of sequences of each queued group (and its env_id) and return the
indices of the groups that form one batch, in batch order, or None. They never touch the groups
themselves, so forming a batch costs a pass over a list of small ints.

Packing rule (upstream): groups are packed into "packs" of ``max_group_size`` sequences (group
sizes are assumed to be powers of two that divide the batch size); a batch is exactly
``batch_size`` sequences taken pack by pack in queue order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["find_groups_summing_to_target", "grab_exact", "grab_with_minimums"]


def find_groups_summing_to_target(sizes: Sequence[int], target: int) -> list[int]:
    """Indices of buffered groups whose sizes sum to ``target``: FIFO first, then a subset-sum
    search preferring earlier groups; [] if none."""
    if not sizes:
        return []
    total, fifo = 0, []
    for i, size in enumerate(sizes):
        if total + size <= target:
            fifo.append(i)
            total += size
            if total == target:
                return fifo
    # reach[i]: bit j set when sum j can be made from the first i groups. A bitset per row: the
    # search costs n × target / 64 word operations and n × target bits, not Python lists of cells.
    mask = (1 << (target + 1)) - 1
    reach = [1]
    for size in sizes:
        prev = reach[-1]
        reach.append(prev | ((prev << size) & mask) if 0 < size <= target else prev)
    if not reach[-1] >> target & 1:
        return []
    picked, j = [], target
    for i in range(len(sizes), 0, -1):
        size = sizes[i - 1]
        if 0 < size <= j and reach[i - 1] >> (j - size) & 1:
            picked.append(i - 1)
            j -= size
    return sorted(picked)


def grab_exact(sizes: Sequence[int], batch_size: int) -> list[int] | None:
    """``grab_exact_from_heterogeneous_queue``: groups completing packs, in the order the packs
    complete, until exactly ``batch_size`` sequences."""
    if not sizes or sum(sizes) < batch_size:
        return None
    max_size = max(sizes)
    open_packs: dict[int, list[int]] = {}
    chosen: list[int] = []
    running = 0
    for i, size in enumerate(sizes):
        pack = open_packs.setdefault(size, [])
        pack.append(i)
        if len(pack) * size != max_size:
            continue
        for j in pack:
            chosen.append(j)
            running += sizes[j]
            if running == batch_size:
                return chosen
            if running > batch_size:
                return None
        pack.clear()
    return None


def grab_with_minimums(
    sizes: Sequence[int], env_ids: Sequence[int | None], batch_size: int, minimums: Mapping[int, float]
) -> list[int] | None:
    """``grab_batch_with_minimum_allocations``: ``minimums`` maps the env_id of every connected
    environment with a ``min_batch_allocation`` to that fraction (in registration order)."""
    if not sizes:
        return None
    if not minimums:
        return grab_exact(sizes, batch_size)
    max_size = max(sizes)
    open_packs: dict[int, dict[int, list[int]]] = {}
    packable: dict[int, list[int]] = {}
    for i, (size, env) in enumerate(zip(sizes, env_ids, strict=True)):
        if env is None:
            continue
        by_size = open_packs.setdefault(env, {})
        packable.setdefault(env, [])
        pack = by_size.setdefault(size, [])
        pack.append(i)
        if len(pack) * size == max_size:
            packable[env].extend(pack)
            by_size[size] = []

    wanted: dict[int, int] = {}
    for env, fraction in minimums.items():
        need = int(batch_size * fraction)
        if need <= 0:
            continue
        if not packable.get(env):
            return None  # an env with a minimum has nothing packable: no batch yet
        wanted[env] = need
    total_wanted = sum(wanted.values())
    if total_wanted > batch_size:
        scale = batch_size / total_wanted
        for env in wanted:
            smallest = min(sizes[i] for i in packable[env])
            wanted[env] = max(smallest, int(wanted[env] * scale))

    chosen: list[int] = []
    taken_set: set[int] = set()
    total = 0
    for env, need in wanted.items():
        taken = 0
        for i in packable[env]:
            if taken >= need:
                break
            if total + sizes[i] <= batch_size:
                chosen.append(i)
                taken_set.add(i)
                taken += sizes[i]
                total += sizes[i]
    if total < batch_size:
        all_packable = {i for items in packable.values() for i in items}
        for i in range(len(sizes)):
            if i in taken_set or i not in all_packable:
                continue
            if total + sizes[i] <= batch_size:
                chosen.append(i)
                total += sizes[i]
            if total == batch_size:
                break
    return chosen if total == batch_size else None
