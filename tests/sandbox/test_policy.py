"""Create bodies checked field by field (no engine needed): what is refused and why, the labels
set over a client's own, the default memory, the engine's socket never mounted; and the
``[sandbox]`` keys of the config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from atroposd.config import parse_toml
from atroposd.sandbox.labels import Owner, job_id, socket_path
from atroposd.sandbox.policy import Policy, Refused, parse_memory
from tests.support import config_problems

OWNER = Owner(job="0123456789abcdef", env="box", replica=1, launch="feedbeef")
SOCK = "/run/podman/podman.sock"


def policy(allow: bool = False) -> Policy:
    return Policy(allow_privileged=allow, memory=4 << 30, engine_socket=SOCK)


def check(host: dict[str, Any], allow: bool = False, **top: Any) -> dict[str, Any]:
    return policy(allow).check_container({"Image": "x", **top, "HostConfig": host}, OWNER, lambda ref: ref == "mine")


@pytest.mark.parametrize(
    ("host", "reason"),
    [
        ({"Privileged": True}, "privileged"),
        ({"NetworkMode": "host"}, "host_namespace"),
        ({"PidMode": "host"}, "host_namespace"),
        ({"IpcMode": "host"}, "host_namespace"),
        ({"UTSMode": "host"}, "host_namespace"),
        ({"UsernsMode": "host"}, "host_namespace"),
        ({"CgroupnsMode": "host"}, "host_namespace"),
        ({"CapAdd": ["NET_ADMIN"]}, "capabilities"),
        ({"Devices": [{"PathOnHost": "/dev/kvm"}]}, "devices"),
        ({"DeviceRequests": [{"Count": -1}]}, "devices"),
        ({"SecurityOpt": ["apparmor=unconfined"]}, "security_opt"),
        ({"SecurityOpt": ["label=disable"]}, "security_opt"),
        ({"Binds": ["/home:/h"]}, "bind_mount"),
        ({"Mounts": [{"Type": "bind", "Source": "/srv", "Target": "/s"}]}, "bind_mount"),
        (
            {"Mounts": [{"Type": "volume", "VolumeOptions": {"DriverConfig": {"Options": {"device": "/srv"}}}}]},
            "bind_mount",
        ),
    ],
)
def test_refused_unless_allowed(host: dict[str, Any], reason: str | None) -> None:
    with pytest.raises(Refused) as err:
        check(host)
    assert err.value.status == 403 and (reason is None or err.value.reason == reason)
    assert "allow_privileged" in err.value.message
    check(host, allow=True)  # allowed with allow_privileged (none of these mounts the engine's socket)


@pytest.mark.parametrize("source", [SOCK, "/run/podman", "/run", "/", "/run/podman/../podman/podman.sock"])
def test_the_engines_socket_is_never_mounted(source: str) -> None:
    for allow in (False, True):
        with pytest.raises(Refused, match="refused always") as err:
            check({"Binds": [f"{source}:/x"]}, allow=allow)
        assert err.value.reason == "engine_socket"
        with pytest.raises(Refused, match="refused always"):
            check({"Mounts": [{"Type": "bind", "Source": source, "Target": "/x"}]}, allow=allow)


def test_labels_memory_and_what_passes() -> None:
    out = check(
        {"Binds": ["named-volume:/data"], "Mounts": [{"Type": "tmpfs", "Target": "/t"}], "CapDrop": ["ALL"]},
        Labels={"mine": "yes", "atroposd.job": "someone-else"},
    )
    assert out["Labels"] == {"mine": "yes", **OWNER.labels}  # a client cannot set atroposd.* itself
    assert out["HostConfig"]["Memory"] == 4 << 30
    assert check({"Memory": 1 << 26})["HostConfig"]["Memory"] == 1 << 26
    assert check({"NetworkMode": "container:mine"})["HostConfig"]["NetworkMode"] == "container:mine"
    with pytest.raises(Refused) as err:
        check({"NetworkMode": "container:theirs"})
    assert err.value.status == 404 and err.value.message == "No such container: theirs"
    with pytest.raises(Refused, match="No such container: other"):
        check({"VolumesFrom": ["other:ro"]})


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ([], "the create body"),
        ({"Image": 3}, "Image"),
        ({"Image": "x", "Labels": {"a": 1}}, "Labels"),
        ({"Image": "x", "HostConfig": []}, "HostConfig"),
        ({"Image": "x", "HostConfig": {"Privileged": "yes"}}, "HostConfig.Privileged"),
        ({"Image": "x", "HostConfig": {"Binds": "/etc:/etc"}}, "HostConfig.Binds"),
        ({"Image": "x", "HostConfig": {"Memory": -1}}, "HostConfig.Memory"),
        ({"Image": "x", "HostConfig": {"CapAdd": "ALL"}}, "HostConfig.CapAdd"),
        ({"Image": "x", "HostConfig": {"Mounts": [3]}}, "HostConfig.Mounts[0]"),
    ],
)
def test_wrong_types_are_named(body: Any, field: str) -> None:
    with pytest.raises(Refused) as err:
        policy().check_container(body, OWNER, lambda ref: False)
    assert err.value.status == 400 and err.value.message.startswith(f"atroposd: {field} must be")


def test_volumes_and_networks() -> None:
    p = policy()
    assert p.check_volume({"Name": "v"}, OWNER)["Labels"] == OWNER.labels
    with pytest.raises(Refused, match="bind mount"):
        p.check_volume({"DriverOpts": {"type": "none", "o": "bind", "device": "/etc"}}, OWNER)
    assert p.check_network({"Name": "n", "Labels": {"k": "v"}}, OWNER)["Labels"] == {"k": "v", **OWNER.labels}
    with pytest.raises(Refused, match="Name must be"):
        p.check_network({}, OWNER)


def test_owner_job_id_and_socket_paths(tmp_path: Path) -> None:
    assert OWNER.owns(OWNER.labels) and OWNER.owns({**OWNER.labels, "atroposd.launch": "earlier"})
    assert not OWNER.owns({**OWNER.labels, "atroposd.replica": "0"}) and not OWNER.owns(None)
    (tmp_path / "state").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "state")
    assert job_id(tmp_path / "state") == job_id(tmp_path / "link") != job_id(tmp_path / "other")
    assert socket_path(tmp_path, "box-1") == tmp_path / "sandbox" / "box-1.sock"
    long = socket_path(Path("/" + "d" * 80), "e" * 60 + "-0")
    assert len(str(long)) <= 107 and long.suffix == ".sock"


def test_memory_sizes() -> None:
    assert parse_memory("4g") == 4 << 30 and parse_memory("512m") == 512 << 20 and parse_memory("1GiB") == 1 << 30
    for bad in ("lots", "1k", "-1g", ""):
        with pytest.raises(ValueError):
            parse_memory(bad)


def test_config_keys() -> None:
    cfg = parse_toml('[sandbox]\nengine = "unix:///run/podman/podman.sock"\nmemory = "2g"\n')
    assert cfg.sandbox.engine == "unix:///run/podman/podman.sock" and cfg.sandbox.max_containers == 32
    problems = config_problems('[sandbox]\nengine = "tcp://10.0.0.1:2375"\nmemory = "huge"\nmax_containers = 0\n')
    text = "\n".join(problems)
    assert "sandbox.engine" in text and "sandbox.memory" in text and "sandbox.max_containers" in text
    deep = "/tmp/" + "r" * 80
    assert any(
        "daemon.runtime_dir" in p
        for p in config_problems(f'[daemon]\nruntime_dir = "{deep}"\n[sandbox]\nengine = "unix:///run/x.sock"\n')
    )
