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

__all__ = ["EXT_KEY", "extension", "extension_for_write"]

#: the one ``group_overrides`` key for atroposd's extensions
EXT_KEY = "atroposd"


def extension(group: Any) -> Mapping[str, Any]:
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
