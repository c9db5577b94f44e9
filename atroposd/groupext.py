"""atroposd's own fields in a scored group: one key, ``group_overrides.atroposd``.

Atropos passes ``group_overrides`` through untouched (ATROPOS-PROTOCOL.md), so atroposd keeps
everything it adds to a group under one key there: the built-in environments' ``weight_version``,
``accuracy``, ``reward_mean`` and ``env``, and the rollout ``timing`` (:mod:`atroposd.timeline`).
Readers take it through :func:`extension`, which tolerates any shape (a group from elsewhere may
carry anything, or nothing, there).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["EXT_KEY", "extension", "extension_for_write", "sampled_versions", "version_records"]

#: the one ``group_overrides`` key for atroposd's extensions
EXT_KEY = "atroposd"


def extension(group: object) -> Mapping[str, Any]:
    """A group's ``group_overrides.atroposd`` (empty when absent or not a mapping)."""
    overrides = group.get("group_overrides") if isinstance(group, Mapping) else None
    ext = overrides.get(EXT_KEY) if isinstance(overrides, Mapping) else None
    return ext if isinstance(ext, Mapping) else {}


def extension_for_write(payload: dict[str, Any]) -> dict[str, Any] | None:
    """The payload's ``group_overrides.atroposd`` to add fields to (created when absent); None
    when the group's own ``group_overrides`` or its ``atroposd`` entry is not a dict (left as is)."""
    overrides = payload.get("group_overrides")
    if overrides is None:
        overrides = payload["group_overrides"] = {}
    if not isinstance(overrides, dict):
        return None
    ext = overrides.get(EXT_KEY)
    if ext is None:
        ext = overrides[EXT_KEY] = {}
    return ext if isinstance(ext, dict) else None


def version_records(group: object, sequences: int) -> list[list[tuple[int, int]]] | None:
    """A group's ``group_overrides.atroposd.weight_versions`` (SPEC §7): per sequence, the
    ``[token_index, version]`` pairs of the weights that sampled its completion's tokens, from
    ``[0, weight_version]`` on (token indices count the completion's tokens). None when absent;
    ValueError naming what is wrong when malformed."""
    ext = extension(group)
    raw = ext.get("weight_versions")
    if raw is None:
        return None
    if not isinstance(raw, list) or len(raw) != sequences:
        raise ValueError(f"weight_versions must be a list with one entry per sequence ({sequences}), got {raw!r:.200}")
    admitted = ext.get("weight_version")
    out: list[list[tuple[int, int]]] = []
    for i, record in enumerate(raw):
        if not isinstance(record, list) or not record:
            raise ValueError(f"weight_versions[{i}] must be a non-empty list of [token_index, version] pairs")
        pairs: list[tuple[int, int]] = []
        for pair in record:
            if not isinstance(pair, list) or len(pair) != 2 or not all(type(x) is int and 0 <= x < 2**53 for x in pair):
                raise ValueError(f"weight_versions[{i}]: {pair!r:.80} is not a [token_index, version] pair")
            # [[0, weight_version], [0, v], ...]: the first span may be empty (a copy of an n > 1
            # request first scheduled after a swap that its siblings began before)
            empty_first = len(pairs) == 1 and pair[0] == 0
            if pairs and ((pair[0] <= pairs[-1][0] and not empty_first) or pair[1] == pairs[-1][1]):
                raise ValueError(f"weight_versions[{i}]: token indices must increase and versions change")
            pairs.append((pair[0], pair[1]))
        if pairs[0][0] != 0:
            raise ValueError(f"weight_versions[{i}] must start at token 0")
        if type(admitted) is int and pairs[0][1] != admitted:
            raise ValueError(f"weight_versions[{i}] starts at version {pairs[0][1]}, not weight_version {admitted}")
        out.append(pairs)
    return out


def sampled_versions(group: object) -> list[int]:
    """Every weight version a group's tokens were sampled under: from ``weight_versions`` when
    it carries a valid one, else its ``weight_version`` (empty: it says nothing)."""
    version = extension(group).get("weight_version")
    tokens = group.get("tokens") if isinstance(group, Mapping) else None
    try:
        records = version_records(group, len(tokens) if isinstance(tokens, list) else -1)
    except ValueError:
        records = None
    if records:  # a span of no tokens (an empty first one) sampled nothing
        return sorted({v for record in records for j, (_, v) in enumerate(record) if not _empty(record, j)})
    return [version] if type(version) is int else []


def _empty(record: list[tuple[int, int]], j: int) -> bool:
    """Whether span ``j`` of a record holds no token (the next one starts where it does)."""
    return j + 1 < len(record) and record[j + 1][0] == record[j][0]
