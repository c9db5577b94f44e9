"""Create bodies checked field by field before anything reaches the engine (SPEC §13, §16).

A container create is refused, unless ``allow_privileged``, when it asks for: privileged mode,
a host namespace (network, PID, IPC, UTS, user, cgroup) or another's (``container:ID`` of a
container this replica does not own), added capabilities, devices, unconfined security
options, or a bind mount of a host path.  A mount of the engine's own socket (or of a directory
holding it) is refused always.  A container whose request sets no memory limit gets
``[sandbox] memory``.  Every field read here is type-checked; a wrong type is refused naming it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from atroposd.sandbox.labels import Owner, with_labels

_MEMORY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
MIN_MEMORY = 6 << 20  # the engines' own floor (6 MiB)

# HostConfig namespace modes: field → what it is called in an error
_NAMESPACES = {
    "NetworkMode": "network",
    "PidMode": "PID",
    "IpcMode": "IPC",
    "UTSMode": "UTS",
    "UsernsMode": "user",
    "CgroupnsMode": "cgroup",
}
_UNCONFINED = ("unconfined", "disable")


def parse_memory(text: str) -> int:
    """``"4g"``, ``"512m"``, ``"1073741824"`` → bytes; ValueError naming the problem."""
    m = _MEMORY.match(text)
    if not m:
        raise ValueError(f"{text!r} is not a size (a number with an optional k, m, g or t suffix)")
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value < MIN_MEMORY:
        raise ValueError(f"{text!r} is below the engines' minimum of 6 MiB")
    return value


class Refused(Exception):
    """A request refused before it reaches the engine: the HTTP status, the message the client
    sees, and the reason it is counted under."""

    def __init__(self, status: int, message: str, reason: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.reason = reason


def _bad(field: str, expected: str, value: object) -> Refused:
    return Refused(400, f"atroposd: {field} must be {expected}, got {type(value).__name__}", "bad_body")


def _forbidden(message: str, reason: str) -> Refused:
    return Refused(403, f"atroposd: {message} (refused by [sandbox]; allow_privileged = true permits it)", reason)


@dataclass(frozen=True)
class Policy:
    allow_privileged: bool
    memory: int  # bytes; given to a container that sets no limit
    engine_socket: str  # the engine's socket path (never mounted)

    def _socket_mount(self, source: str) -> bool:
        """Whether mounting ``source`` exposes the engine's socket (the socket or a directory above it)."""
        sock = os.path.normpath(self.engine_socket)
        paths = {sock, os.path.realpath(sock)}
        src = os.path.normpath(source)
        for candidate in {src, os.path.realpath(src)}:
            for p in paths:
                if candidate == p or candidate == "/" or p.startswith(candidate.rstrip("/") + "/"):
                    return True
        return False

    def _host_path(self, field: str, source: str) -> None:
        if self._socket_mount(source):
            raise Refused(
                403,
                f"atroposd: {field} mounts the container engine's socket ({source}): refused always",
                "engine_socket",
            )
        if not self.allow_privileged:
            raise _forbidden(f"{field} is a bind mount of the host path {source}", "bind_mount")

    def check_container(self, body: object, owner: Owner, owned: Callable[[str], bool]) -> dict[str, Any]:
        """The create body to forward (labels set, memory defaulted), or Refused.

        ``owned(ref)``: whether a container named by ``ref`` (``container:ref`` namespaces,
        ``VolumesFrom``, ``Links``) is this replica's; checked only for those fields."""
        if not isinstance(body, dict):
            raise _bad("the create body", "a JSON object", body)
        image = body.get("Image")
        if not isinstance(image, str) or not image:
            raise _bad("Image", "an image name (a non-empty string)", image)
        labels = body.get("Labels")
        if labels is not None and not (isinstance(labels, dict) and all(isinstance(v, str) for v in labels.values())):
            raise _bad("Labels", "an object of strings", labels)
        host = body.get("HostConfig")
        if host is None:
            host = {}
        if not isinstance(host, dict):
            raise _bad("HostConfig", "an object", host)
        self._check_host(host, owned)
        memory = host.get("Memory")
        if memory is not None and (not isinstance(memory, int) or isinstance(memory, bool) or memory < 0):
            raise _bad("HostConfig.Memory", "a byte count (a non-negative integer)", memory)
        if not memory:
            host["Memory"] = self.memory
        out = dict(body)
        out["HostConfig"] = host
        out["Labels"] = with_labels(labels, owner)
        return out

    def _check_host(self, host: Mapping[str, Any], owned: Callable[[str], bool]) -> None:
        priv = host.get("Privileged")
        if priv is not None and not isinstance(priv, bool):
            raise _bad("HostConfig.Privileged", "a boolean", priv)
        if priv and not self.allow_privileged:
            raise _forbidden("a privileged container", "privileged")
        for key, what in _NAMESPACES.items():
            mode = host.get(key)
            if mode is None:
                continue
            if not isinstance(mode, str):
                raise _bad(f"HostConfig.{key}", "a string", mode)
            if mode == "host" and not self.allow_privileged:
                raise _forbidden(f"the host's {what} namespace (HostConfig.{key} = host)", "host_namespace")
            if mode.startswith("container:") and not owned(mode.split(":", 1)[1]):
                raise Refused(404, f"No such container: {mode.split(':', 1)[1]}", "not_owned")
            if mode.startswith("ns:") and not self.allow_privileged:
                raise _forbidden(f"a namespace of the host by path (HostConfig.{key} = {mode})", "host_namespace")
        for key, what, reason in (
            ("CapAdd", "added capabilities", "capabilities"),
            ("Devices", "devices", "devices"),
            ("DeviceRequests", "device requests", "devices"),
            ("DeviceCgroupRules", "device cgroup rules", "devices"),
        ):
            value = host.get(key)
            if value is None:
                continue
            if not isinstance(value, list):
                raise _bad(f"HostConfig.{key}", "a list", value)
            if value and not self.allow_privileged:
                raise _forbidden(f"{what} (HostConfig.{key})", reason)
        security = host.get("SecurityOpt")
        if security is not None:
            if not isinstance(security, list) or not all(isinstance(s, str) for s in security):
                raise _bad("HostConfig.SecurityOpt", "a list of strings", security)
            for opt in security:
                if not self.allow_privileged and any(word in opt.lower() for word in _UNCONFINED):
                    raise _forbidden(f"the security option {opt!r}", "security_opt")
        self._check_binds(host)
        self._check_mounts(host)
        for key in ("VolumesFrom", "Links"):
            refs = host.get(key)
            if refs is None:
                continue
            if not isinstance(refs, list) or not all(isinstance(r, str) for r in refs):
                raise _bad(f"HostConfig.{key}", "a list of strings", refs)
            for ref in refs:
                name = ref.split(":", 1)[0].lstrip("/")
                if not owned(name):
                    raise Refused(404, f"No such container: {name}", "not_owned")

    def _check_binds(self, host: Mapping[str, Any]) -> None:
        binds = host.get("Binds")
        if binds is None:
            return
        if not isinstance(binds, list) or not all(isinstance(b, str) for b in binds):
            raise _bad("HostConfig.Binds", "a list of strings", binds)
        for bind in binds:
            source = bind.split(":", 1)[0]
            if source.startswith("/") or source.startswith("."):  # a path; otherwise a named volume
                self._host_path("HostConfig.Binds", source)

    def _check_mounts(self, host: Mapping[str, Any]) -> None:
        mounts = host.get("Mounts")
        if mounts is None:
            return
        if not isinstance(mounts, list):
            raise _bad("HostConfig.Mounts", "a list", mounts)
        for i, mount in enumerate(mounts):
            if not isinstance(mount, dict):
                raise _bad(f"HostConfig.Mounts[{i}]", "an object", mount)
            kind = mount.get("Type", "volume")
            source = mount.get("Source", "")
            if not isinstance(kind, str) or not isinstance(source, str):
                raise _bad(f"HostConfig.Mounts[{i}].Type/Source", "strings", mount)
            if kind == "bind" or (kind not in ("volume", "tmpfs") and source.startswith("/")):
                self._host_path(f"HostConfig.Mounts[{i}]", source or "?")
            elif kind not in ("volume", "tmpfs") and not self.allow_privileged:
                raise _forbidden(f"a mount of type {kind!r} (HostConfig.Mounts[{i}])", "bind_mount")
            options = mount.get("VolumeOptions")
            if kind == "volume" and options is not None:
                self._check_driver_options(f"HostConfig.Mounts[{i}].VolumeOptions.DriverConfig.Options", options)

    def _check_driver_options(self, field: str, options: object) -> None:
        if not isinstance(options, dict):
            raise _bad(field.rsplit(".DriverConfig", 1)[0], "an object", options)
        driver = options.get("DriverConfig") or {}
        if not isinstance(driver, dict):
            raise _bad(field, "an object", driver)
        self.check_driver_opts(field, driver.get("Options"))

    def check_driver_opts(self, field: str, opts: object) -> None:
        """A volume's driver options: ``device`` with a host path (``o=bind``) is a bind mount."""
        if opts is None:
            return
        if not isinstance(opts, dict) or not all(isinstance(v, str) for v in opts.values()):
            raise _bad(field, "an object of strings", opts)
        device = opts.get("device", "")
        if device.startswith("/") or "bind" in opts.get("o", ""):
            self._host_path(field, device or "?")

    def check_volume(self, body: object, owner: Owner) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise _bad("the volume create body", "a JSON object", body)
        labels = body.get("Labels")
        if labels is not None and not (isinstance(labels, dict) and all(isinstance(v, str) for v in labels.values())):
            raise _bad("Labels", "an object of strings", labels)
        self.check_driver_opts("DriverOpts", body.get("DriverOpts"))
        return {**body, "Labels": with_labels(labels, owner)}

    def check_network(self, body: object, owner: Owner) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise _bad("the network create body", "a JSON object", body)
        labels = body.get("Labels")
        if labels is not None and not (isinstance(labels, dict) and all(isinstance(v, str) for v in labels.values())):
            raise _bad("Labels", "an object of strings", labels)
        name = body.get("Name")
        if not isinstance(name, str) or not name:
            raise _bad("Name", "a non-empty string", name)
        return {**body, "Labels": with_labels(labels, owner)}
