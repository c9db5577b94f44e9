"""Nothing left behind, containers included (SPEC §16): a replica's restart removes its
containers, the next start after ``kill -9`` of the daemon removes what the dead launch left,
``stop`` removes everything labelled with the job, max_age and max_containers hold, and nothing
without the job's labels is ever touched."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from atroposd.sandbox.labels import job_id
from tests.daemon.conftest import SCRIPTS, Job
from tests.sandbox.conftest import IMAGE, sandbox_env, sandbox_job, socket_of
from tests.sandbox.engine import Podman
from tests.support import wait_for

docker = pytest.importorskip("docker")
pytestmark = pytest.mark.slow


def starter(ids: Path, n: int) -> list[str]:
    """An environment that starts ``n`` containers whose first process ignores SIGTERM."""
    return [sys.executable, str(SCRIPTS / "sandbox_env.py"), str(ids), str(n), IMAGE]


def lines(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def labelled(podman: Podman, job: Job) -> list[dict[str, Any]]:
    return podman.containers(f"label=atroposd.job={job_id(job.state_dir)}")


def events(job: Job) -> list[dict[str, Any]]:
    log = job.state_dir / "logs" / "daemon.log"
    return [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]


def outsiders(podman: Podman) -> list[str]:
    """A container made on the engine directly and one of another job: never to be touched."""
    direct = podman.podman("create", IMAGE, "sleep", "300").stdout.strip()
    other = podman.podman(
        "create", "--label", "atroposd.job=ffffffffffffffff", "--label", "atroposd.env=box",
        "--label", "atroposd.replica=0", IMAGE, "sleep", "300",
    ).stdout.strip()  # fmt: skip
    return [direct, other]


def test_a_replicas_restart_removes_its_containers(podman: Podman, sandbox_tmp: Path) -> None:
    ids = sandbox_tmp / "ids"
    job = sandbox_job(sandbox_tmp, podman, [sandbox_env("box", starter(ids, 2))])
    keep = outsiders(podman)
    try:
        assert job.cli("start").returncode == 0
        wait_for(lambda: len(lines(ids)) == 2, timeout=30, what="the first launch's containers")
        first = lines(ids)
        pid = job.component("box-0")["pid"]
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: len(lines(ids)) == 4, timeout=30, what="the restarted environment's containers")
        live = {c["Id"] for c in labelled(podman, job)}
        assert not live & set(first), "the killed environment's containers outlived its restart"
        assert live == set(lines(ids)[2:])
        assert job.status()["sandbox"]["removed"]["restart"] == 2
        assert {c["Id"] for c in podman.containers()} >= set(keep)
    finally:
        assert job.cli("stop", timeout=60).returncode == 0
        podman.podman("rm", "-f", *keep)
    assert not labelled(podman, job)


def test_kill_9_of_the_daemon_then_the_next_start_removes_them(podman: Podman, sandbox_tmp: Path) -> None:
    ids = sandbox_tmp / "ids"
    job = sandbox_job(sandbox_tmp, podman, [sandbox_env("box", starter(ids, 3))])
    keep = outsiders(podman)
    try:
        assert job.cli("start").returncode == 0
        wait_for(lambda: len(lines(ids)) == 3, timeout=30, what="the containers")
        docker_client = docker.DockerClient(base_url=socket_of(job, "box-0"), timeout=30)
        docker_client.volumes.create("left-vol")
        docker_client.networks.create("left-net")
        docker_client.close()
        pid = job.daemon_pid()
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not psutil.pid_exists(pid), timeout=10, what="the daemon gone")
        assert {c["Id"] for c in labelled(podman, job)} == set(lines(ids))  # the crash left them
        assert job.cli("start").returncode == 0
        gone = set(lines(ids)[:3])
        wait_for(lambda: len(lines(ids)) == 6, timeout=30, what="the new launch's containers")
        live = {c["Id"] for c in labelled(podman, job)}
        assert not live & gone and live == set(lines(ids)[3:])
        assert job.status()["sandbox"]["removed"]["crash"] == 3
        assert "left-vol" not in podman.podman("volume", "ls", "-q").stdout
        assert "left-net" not in podman.podman("network", "ls").stdout
        assert job.cli("stop", timeout=60).returncode == 0
        # three containers whose first process ignores SIGTERM: killed and removed in parallel,
        # within stop_timeout as the daemon measured it (the command's wall time adds interpreters)
        removals = [
            e for e in events(job) if e.get("event") == "removed an environment's containers" and e["reason"] == "stop"
        ]
        assert removals and all(e["seconds"] < 3.0 and not e["left"] for e in removals), removals
        assert not labelled(podman, job)
        assert {c["Id"] for c in podman.containers()} >= set(keep)
    finally:
        if job.daemon_pid() and psutil.pid_exists(job.daemon_pid() or 0):
            job.cli("stop", timeout=60)
        podman.podman("rm", "-f", *keep)


def test_stop_removes_everything_labelled_with_the_job(podman: Podman, sandbox_tmp: Path) -> None:
    ids = sandbox_tmp / "ids"
    job = sandbox_job(sandbox_tmp, podman, [sandbox_env("box", starter(ids, 2), replicas=2)])
    assert job.cli("start").returncode == 0
    try:
        wait_for(lambda: len(lines(ids)) == 4, timeout=30, what="both replicas' containers")
        c = docker.DockerClient(base_url=socket_of(job, "box-1"), timeout=30)
        c.volumes.create("job-vol")
        c.networks.create("job-net")
        c.containers.create(IMAGE, ["sleep", "300"])  # created, never started
        c.close()
        assert len(labelled(podman, job)) == 5
    finally:
        assert job.cli("stop", timeout=60).returncode == 0
    assert not labelled(podman, job)
    assert "job-vol" not in podman.podman("volume", "ls", "-q").stdout
    assert "job-net" not in podman.podman("network", "ls").stdout


def test_max_age_removes_old_containers(podman: Podman, sandbox_tmp: Path) -> None:
    ids = sandbox_tmp / "ids"
    job = sandbox_job(sandbox_tmp, podman, [sandbox_env("box", starter(ids, 2))], max_age=1.0)
    assert job.cli("start").returncode == 0
    try:
        wait_for(lambda: len(lines(ids)) == 2, timeout=30, what="the containers")
        wait_for(lambda: not labelled(podman, job), timeout=15, what="containers past max_age removed")
        wait_for(lambda: job.status()["sandbox"]["removed"]["max_age"] == 2, timeout=10, what="counted")
    finally:
        assert job.cli("stop", timeout=60).returncode == 0


def test_max_containers_refuses_the_next_create(podman: Podman, sandbox_tmp: Path) -> None:
    ids = sandbox_tmp / "ids"
    job = sandbox_job(sandbox_tmp, podman, [sandbox_env("box", starter(ids, 2))], max_containers=2)
    assert job.cli("start").returncode == 0
    try:
        wait_for(lambda: len(lines(ids)) == 2, timeout=30, what="the containers")
        c = docker.DockerClient(base_url=socket_of(job, "box-0"), timeout=30)
        with pytest.raises(docker.errors.APIError, match=r"max_containers = 2") as err:
            c.containers.create(IMAGE, ["true"])
        assert err.value.status_code == 409
        c.close()
        assert len(labelled(podman, job)) == 2
        assert job.status()["sandbox"]["refused"]["max_containers"] == 1
    finally:
        assert job.cli("stop", timeout=60).returncode == 0


def test_reload_removing_an_environment_removes_its_containers_and_socket(podman: Podman, sandbox_tmp: Path) -> None:
    kept, dropped = sandbox_tmp / "kept", sandbox_tmp / "dropped"
    envs = [sandbox_env("box", starter(kept, 1)), sandbox_env("gone", starter(dropped, 2))]
    job = sandbox_job(sandbox_tmp, podman, envs)
    assert job.cli("start").returncode == 0
    try:
        wait_for(lambda: len(lines(kept)) == 1 and len(lines(dropped)) == 2, timeout=30, what="the containers")
        job.write(env=[envs[0]])
        r = job.cli("reload")
        assert r.returncode == 0, r.stderr
        assert not (job.runtime_dir / "sandbox" / "gone-0.sock").exists()
        assert (job.runtime_dir / "sandbox" / "box-0.sock").exists()
        assert {c["Id"] for c in labelled(podman, job)} == set(lines(kept))
        assert job.status()["sandbox"]["removed"]["stop"] == 2
    finally:
        assert job.cli("stop", timeout=60).returncode == 0
    assert not labelled(podman, job)
