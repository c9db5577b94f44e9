"""Through an environment replica's socket, against a real engine: unmodified clients (docker-py,
the docker CLI) work, everything they create is labelled, a replica reaches only its own objects,
and what SPEC §16 refuses is refused with a Docker API error naming the reason."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from atroposd.sandbox.labels import job_id
from tests.daemon.conftest import Job, _teardown, base_sections
from tests.sandbox.conftest import IMAGE, sandbox_env, socket_of
from tests.sandbox.engine import Podman
from tests.support import free_port, wait_for

docker = pytest.importorskip("docker")


@pytest.fixture(scope="module")
def job(podman: Podman) -> Iterator[Job]:
    d = Path(tempfile.mkdtemp(prefix="apd-sp-", dir="/tmp"))
    j = Job(d, d / "atroposd.toml")
    envs = [sandbox_env("box", replicas=2), sandbox_env("other")]
    j.write(**base_sections(d, envs, sandbox={"engine": podman.url}, daemon={"metrics_port": free_port()}))
    try:
        r = j.cli("start", timeout=60)
        assert r.returncode == 0, r.stderr[-3000:]
        yield j
    finally:
        _teardown(j)
        shutil.rmtree(d, ignore_errors=True)


_open: list[Any] = []


def client(job: Job, unit: str = "box-0") -> Any:
    c = docker.DockerClient(base_url=socket_of(job, unit), timeout=30)
    _open.append(c)
    return c


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    while _open:
        _open.pop().close()


def cli(job: Job, *args: str, unit: str = "box-0", stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DOCKER_")}
    env["DOCKER_HOST"] = socket_of(job, unit)
    env["DOCKER_CONFIG"] = str(job.dir / "docker-config")
    return subprocess.run(["docker", *args], env=env, input=stdin, capture_output=True, text=True, timeout=60)


def test_sockets_are_the_replicas_own_and_0600(job: Job) -> None:
    for unit in ("box-0", "box-1", "other-0"):
        path = job.runtime_dir / "sandbox" / f"{unit}.sock"
        assert stat.S_ISSOCK(path.stat().st_mode) and stat.S_IMODE(path.stat().st_mode) == 0o600
    env = (job.state_dir / "logs" / "box-1.log").read_text()
    assert "starting box-1" in env


def test_docker_py_create_start_logs_wait_exec_remove_labelled(job: Job, podman: Podman) -> None:
    c = client(job)
    box = c.containers.run(IMAGE, ["sh", "-c", "echo out; echo err >&2; exit 3"], detach=True)
    try:
        assert box.wait(timeout=30)["StatusCode"] == 3
        assert box.logs(stdout=True, stderr=False) == b"out\n"
        assert box.logs(stdout=False, stderr=True) == b"err\n"
        status = job.status()
        assert box.labels == {
            "atroposd.job": job_id(job.state_dir),
            "atroposd.env": "box",
            "atroposd.replica": "0",
            "atroposd.launch": status["instance"],
        }
        assert box.attrs["HostConfig"]["Memory"] == 4 << 30  # [sandbox] memory: none was asked for
    finally:
        box.remove(force=True)
    sleeper = c.containers.run(IMAGE, ["sleep", "300"], detach=True, mem_limit="64m")
    try:
        assert sleeper.attrs["HostConfig"]["Memory"] == 64 << 20  # a limit asked for is kept
        # (a short pause first: podman 4.3 itself can lose the output of an exec that ends at once)
        result = sleeper.exec_run(["sh", "-c", "sleep 0.1; echo from-exec; exit 4"])
        assert (result.exit_code, result.output) == (4, b"from-exec\n")
    finally:
        sleeper.remove(force=True)
    assert not podman.containers("label=atroposd.env=box", "label=atroposd.replica=0")


def test_docker_cli_run_attach_stdin_volumes_networks(job: Job, podman: Podman) -> None:
    r = cli(job, "run", "-i", "--rm", IMAGE, "sh", "-c", "read line; echo got:$line", stdin="hello\n")
    assert r.returncode == 0 and r.stdout == "got:hello\n", r.stderr
    cid = cli(job, "run", "-d", IMAGE, "sh", "-c", "echo started; sleep 300").stdout.strip()
    try:
        r = cli(job, "exec", cid, "sh", "-c", "sleep 0.1; echo in-exec; exit 5")
        assert r.returncode == 5 and r.stdout == "in-exec\n", r.stderr
        assert cli(job, "logs", cid).stdout == "started\n"
        assert cli(job, "kill", cid).returncode == 0
        assert cli(job, "wait", cid).stdout.strip() == "137"
        labels = json.loads(cli(job, "inspect", "--format", "{{json .Config.Labels}}", cid).stdout)
        assert labels["atroposd.env"] == "box" and labels["atroposd.replica"] == "0"
    finally:
        assert cli(job, "rm", "-f", cid).returncode == 0
    r = cli(job, "volume", "create", "sbx-vol")
    assert r.returncode == 0, r.stderr
    r = cli(job, "network", "create", "sbx-net")
    assert r.returncode == 0, r.stderr
    try:
        vol = json.loads(podman.podman("volume", "inspect", "sbx-vol").stdout)[0]
        assert vol["Labels"]["atroposd.env"] == "box" and vol["Labels"]["atroposd.job"] == job_id(job.state_dir)
        net = json.loads(podman.podman("network", "inspect", "sbx-net").stdout)[0]
        assert net["labels"]["atroposd.replica"] == "0"
        assert "sbx-vol" in cli(job, "volume", "ls", "-q").stdout
        assert "sbx-net" in cli(job, "network", "ls").stdout
        # another replica sees neither
        assert "sbx-vol" not in cli(job, "volume", "ls", "-q", unit="box-1").stdout
        assert cli(job, "volume", "rm", "sbx-vol", unit="box-1").returncode != 0
        r = cli(job, "run", "--rm", "-v", "sbx-vol:/data", IMAGE, "sh", "-c", "echo kept > /data/f && cat /data/f")
        assert r.returncode == 0 and r.stdout == "kept\n", r.stderr
    finally:
        assert cli(job, "volume", "rm", "sbx-vol").returncode == 0
        assert cli(job, "network", "rm", "sbx-net").returncode == 0


def test_a_replica_reaches_only_its_own(job: Job, podman: Podman) -> None:
    direct = podman.podman("create", IMAGE, "sleep", "300").stdout.strip()
    foreign = podman.podman(
        "create", "--label", "atroposd.job=0123456789abcdef", "--label", "atroposd.env=box",
        "--label", "atroposd.replica=0", IMAGE, "sleep", "300",
    ).stdout.strip()  # fmt: skip
    sibling = client(job, "box-1").containers.create(IMAGE, ["sleep", "300"])
    try:
        mine = client(job, "box-0")
        listed = {c.id for c in mine.containers.list(all=True)}
        for cid in (direct, foreign, sibling.id):
            assert cid not in listed
            for attempt in (
                mine.containers.get,
                lambda ref: mine.api.stop(ref, timeout=0),
                lambda ref: mine.api.remove_container(ref, force=True),
                lambda ref: mine.api.exec_create(ref, ["true"]),
            ):
                with pytest.raises(docker.errors.NotFound, match="No such container"):
                    attempt(cid)
        r = cli(job, "rm", direct[:12])
        assert r.returncode != 0 and r.stderr.strip() == f"Error response from daemon: No such container: {direct[:12]}"
        # all three untouched on the engine
        ids = {c["Id"] for c in podman.containers()}
        assert {direct, foreign, sibling.id} <= ids
    finally:
        sibling.remove(force=True)
        podman.podman("rm", "-f", direct, foreign)


def _refused(c: Any, reason: str, **kw: Any) -> None:
    with pytest.raises(docker.errors.APIError) as err:
        c.containers.create(IMAGE, ["true"], **kw)
    assert err.value.status_code == 403, err.value
    assert reason in str(err.value), err.value


def test_privileges_host_namespaces_and_host_paths_are_refused(job: Job, podman: Podman) -> None:
    c = client(job)
    before = job.status()["sandbox"]["refused"]
    _refused(c, "privileged container", privileged=True)
    _refused(c, "network namespace", network_mode="host")
    _refused(c, "PID namespace", pid_mode="host")
    _refused(c, "IPC namespace", ipc_mode="host")
    _refused(c, "user namespace", userns_mode="host")
    _refused(c, "added capabilities", cap_add=["SYS_ADMIN"])
    _refused(c, "devices", devices=["/dev/fuse:/dev/fuse:rwm"])
    _refused(c, "security option", security_opt=["seccomp=unconfined"])
    _refused(c, "bind mount of the host path /etc", volumes={"/etc": {"bind": "/host-etc", "mode": "ro"}})
    _refused(c, "engine's socket", volumes={str(podman.socket): {"bind": "/run/docker.sock"}})
    _refused(c, "engine's socket", volumes={str(podman.dir): {"bind": "/run/x"}})
    with pytest.raises(docker.errors.APIError, match="bind mount"):
        c.volumes.create("sneaky", driver_opts={"type": "none", "o": "bind", "device": "/etc"})
    after = job.status()["sandbox"]["refused"]
    for reason, n in (("privileged", 1), ("host_namespace", 4), ("capabilities", 1), ("devices", 1)):
        assert after.get(reason, 0) - before.get(reason, 0) == n, (reason, after)
    assert after.get("engine_socket", 0) - before.get("engine_socket", 0) == 2
    assert not podman.containers("label=atroposd.env=box")  # nothing reached the engine


def test_status_and_metrics_show_live_containers(job: Job) -> None:
    c = client(job, "other-0")
    boxes = [c.containers.create(IMAGE, ["sleep", "300"]) for _ in range(2)]
    try:
        wait_for(lambda: job.component("other-0").get("containers") == 2, timeout=10, what="2 containers in status")
        st = job.status()["sandbox"]
        assert st["containers_by_env"]["other"] == 2 and st["job"] == job_id(job.state_dir)
        text = job.cli("status").stdout
        assert "other-0 2" in text and "sandbox:" in text
        port = json.loads(job.config.read_text().split("metrics_port = ")[1].split("\n")[0])
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert 'atroposd_sandbox_containers{component="daemon",env="other"} 2.0' in body
        assert "atroposd_sandbox_removed_total" in body and "atroposd_sandbox_refused_total" in body
        from tests.e2e.test_watching import dashboard_metrics

        wanted = {m for m in dashboard_metrics() if m.startswith("atroposd_sandbox_")}
        assert len(wanted) == 3 and all(m in body for m in wanted), wanted  # the dashboard's sandbox panels
    finally:
        for b in boxes:
            b.remove(force=True)
    wait_for(lambda: job.component("other-0").get("containers") == 0, timeout=10, what="0 containers in status")
    assert job.status()["sandbox"]["removed"]["client"] >= 2
