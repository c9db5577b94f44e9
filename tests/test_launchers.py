"""The shipped launch files for several machines (SPEC §12.3): examples/slurm/atroposd.sbatch
and examples/k8s/. They parse, their shape is what the contract asks, and the sbatch file's
config rendering and restart loop do what they say (run with bash, a stand-in atroposd)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from atroposd.config import parse_toml, tomllib
from tests.support import REPO

SBATCH = REPO / "examples" / "slurm" / "atroposd.sbatch"
K8S = REPO / "examples" / "k8s"
BASH = shutil.which("bash")
pytestmark = pytest.mark.skipif(BASH is None, reason="needs bash")


def _bash(
    script: str, *, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    assert BASH is not None
    return subprocess.run(
        [BASH, "-c", script], capture_output=True, text=True, timeout=30, cwd=cwd, env={**os.environ, **(env or {})}
    )


def test_sbatch_parses_and_asks_for_one_task_per_node() -> None:
    assert BASH is not None
    subprocess.run([BASH, "-n", str(SBATCH)], check=True, timeout=30)
    text = SBATCH.read_text()
    assert text.startswith("#!/bin/bash\n")
    assert "#SBATCH --ntasks-per-node=1" in text
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p' in text  # the first host: the head
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        assert f"export {var}=" in text


def _job_config(tmp_path: Path, config_text: str) -> str:
    src = tmp_path / "atroposd.toml"
    src.write_text(config_text)
    out = tmp_path / "job.toml"
    r = _bash(f'source "{SBATCH}"; atroposd_job_config "{src}" "{out}" node-a17 4 /shared/cluster.token')
    assert r.returncode == 0, r.stderr
    return out.read_text()


@pytest.mark.parametrize(
    ("config_text", "cluster"),
    [
        # no [cluster] at all: it is added
        ('[api]\ntoken_file = "/keep/this"\n\n[[env]]\nname = "a"\nbuiltin = "arithmetic"\n', {}),
        # a [cluster] with the keys set: they are replaced, its other keys kept, other sections untouched
        (
            '[cluster]\nnodes = 1\nhead = "old"\nport = 29500 # mine\ntoken_file = "/old"\n\n'
            '[api]\ntoken_file = "/keep/this"\n[[env]]\nname = "a"\nbuiltin = "arithmetic"\n',
            {"port": 29500},
        ),
    ],
)
def test_sbatch_fills_in_this_allocation(
    tmp_path: Path, config_text: str, cluster: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    rendered = _job_config(tmp_path, config_text)
    raw = tomllib.loads(rendered)
    assert raw["cluster"] == {"nodes": 4, "head": "node-a17", "token_file": "/shared/cluster.token", **cluster}
    assert raw["api"] == {"token_file": "/keep/this"} and raw["env"] == [{"name": "a", "builtin": "arithmetic"}]
    # what a node of the allocation then checks (its rank from SLURM_NODEID, as under srun)
    monkeypatch.setenv("SLURM_NODEID", "3")
    token = tmp_path / "token"
    token.write_text("x" * 32)
    cfg = parse_toml(
        rendered.replace('"node-a17"', '"127.0.0.1"').replace("/shared/cluster.token", str(token))
        + f'[trainer]\ncheckpoint_dir = "{tmp_path}"\n'
    )
    assert cfg.cluster.resolve_node_rank() == 3


def test_sbatch_restarts_atroposd_on_exit_1_only(tmp_path: Path) -> None:
    """A stand-in ``atroposd`` that exits with the codes of a list, one per start."""
    fake = tmp_path / "bin"
    fake.mkdir()
    codes = tmp_path / "codes"
    starts = tmp_path / "starts"
    (fake / "atroposd").write_text(
        f'#!/bin/bash\necho "$*" >> "{starts}"\ncode=$(head -n 1 "{codes}"); sed -i 1d "{codes}"; exit "$code"\n'
    )
    (fake / "atroposd").chmod(0o755)
    env = {"PATH": f"{fake}:{os.environ['PATH']}", "ATROPOSD_RESTART_DELAY": "0"}

    def loop(exit_codes: list[int], max_restarts: int = 20) -> tuple[int, int, str]:
        codes.write_text("".join(f"{c}\n" for c in exit_codes))
        starts.write_text("")
        r = _bash(f'source "{SBATCH}"; atroposd_node_loop /cfg.toml {max_restarts}', env=env)
        return r.returncode, len(starts.read_text().splitlines()), r.stderr

    assert loop([1, 1, 0])[:2] == (0, 3)  # exit 1: cleaned up and rejoined; 0: done
    assert loop([1, 2])[:2] == (2, 2)  # a config error is not retried
    assert loop([4])[:2] == (4, 1)  # another daemon already runs there: not retried
    code, n, err = loop([1, 1, 1, 1], max_restarts=2)
    assert (code, n) == (1, 3) and "giving up" in err
    assert starts.read_text().splitlines()[0] == "run -c /cfg.toml"


def _k8s() -> dict[str, dict[str, Any]]:
    docs: dict[str, dict[str, Any]] = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            assert isinstance(doc, dict), path
            docs[doc["kind"]] = doc
    return docs


def test_every_k8s_file_loads_and_the_kustomization_lists_them() -> None:
    docs = _k8s()
    assert set(docs) == {"Kustomization", "Secret", "ConfigMap", "PersistentVolumeClaim", "Service", "StatefulSet"}
    listed = docs["Kustomization"]["resources"]
    assert sorted(listed) == sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def test_k8s_statefulset_behind_a_headless_service_with_node_0_the_head(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = _k8s()
    svc, sts, cm = docs["Service"], docs["StatefulSet"], docs["ConfigMap"]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"]
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in svc["spec"]["selector"].items())
    # the config in the ConfigMap is valid for this StatefulSet
    monkeypatch.setenv("ATROPOSD_NODE_RANK", "1")
    token = tmp_path / "token"
    token.write_text("x" * 32)
    text = cm["data"]["atroposd.toml"]
    cfg = parse_toml(
        text.replace("/etc/atroposd/token/token", str(token)).replace("/shared/checkpoints", str(tmp_path / "ckpt"))
    )
    name = sts["metadata"]["name"]
    assert cfg.cluster.nodes == sts["spec"]["replicas"] == 2
    assert cfg.cluster.head == f"{name}-0.{svc['metadata']['name']}"  # pod 0 through the headless Service
    assert cfg.cluster.resolve_node_rank(environ={}, hostname=f"{name}-1") == 1
    ports = {p["name"]: p["port"] for p in svc["spec"]["ports"]}
    assert ports["cluster"] == cfg.cluster.port and ports["c10d-store"] == cfg.cluster.port + 1
    assert ports["api"] == cfg.api.port
    # the token from the Secret, the config from the ConfigMap, the checkpoints on the shared claim
    pod = sts["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["token"]["secret"]["secretName"] == docs["Secret"]["metadata"]["name"]
    assert "token" in docs["Secret"]["stringData"]
    assert Path(mounts["token"]) / "token" == Path("/etc/atroposd/token/token")
    assert volumes["config"]["configMap"]["name"] == cm["metadata"]["name"]
    assert mounts["config"] == "/etc/atroposd/atroposd.toml" and "/etc/atroposd/atroposd.toml" in container["command"]
    claim = volumes["checkpoints"]["persistentVolumeClaim"]["claimName"]
    assert claim == docs["PersistentVolumeClaim"]["metadata"]["name"]
    assert "ReadWriteMany" in docs["PersistentVolumeClaim"]["spec"]["accessModes"]
    assert mounts["checkpoints"] == "/shared/checkpoints"
    env = {e["name"]: e for e in container["env"]}
    assert "pod-index" in env["ATROPOSD_NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]


def test_sbatch_main_runs_one_loop_per_node_with_its_own_directories(tmp_path: Path) -> None:
    """The whole script under stand-ins for scontrol, srun (two tasks, SLURM_NODEID 0 and 1) and
    atroposd (which records what it was started with)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "record"

    def tool(name: str, body: str) -> None:
        (bin_dir / name).write_text("#!/bin/bash\n" + body)
        (bin_dir / name).chmod(0o755)

    # a long node list: a reader that stops after the first line would break the pipe (SIGPIPE)
    tool("scontrol", "echo node-a17; for i in $(seq 18 20000); do echo node-a$i; done\n")
    # srun NAME... bash -c SCRIPT: run the script once per node, as SLURM would on each
    tool(
        "srun",
        'while [ "$1" != bash ]; do shift; done; shift\n'
        'for id in 0 1; do SLURM_NODEID=$id bash "$@" || exit $?; done\n',
    )
    tool(
        "atroposd",
        f'echo "$SLURM_NODEID $* $RUNTIME_DIRECTORY $STATE_DIRECTORY $GLOO_SOCKET_IFNAME '
        f'$NCCL_SOCKET_IFNAME" >> "{record}"\n',
    )
    config = tmp_path / "atroposd.toml"
    config.write_text('[[env]]\nname = "a"\nbuiltin = "arithmetic"\n')
    token = tmp_path / "secret" / "cluster.token"
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "node-a[17-18]",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_JOB_ID": "4242",
        "ATROPOSD_TOKEN_FILE": str(token),
        "ATROPOSD_LOCAL_DIR": str(tmp_path / "local"),
        "ATROPOSD_IFNAME": "ib0",
        "USER": "u",
    }
    assert BASH is not None
    r = subprocess.run(
        [BASH, str(SBATCH), str(config)],
        capture_output=True,
        text=True,
        timeout=30,
        env={k: v for k, v in {**os.environ, **env}.items() if k not in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")},
    )
    assert r.returncode == 0, r.stderr
    assert len(token.read_text()) == 64 and (token.stat().st_mode & 0o077) == 0  # a fresh secret, private
    job_config = tmp_path / ".atroposd-job-4242.toml"
    assert tomllib.loads(job_config.read_text())["cluster"] == {
        "nodes": 2,
        "head": "node-a17",
        "token_file": str(token),
    }
    local = tmp_path / "local" / "atroposd-u-4242"
    assert record.read_text().splitlines() == [
        f"{i} run -c {job_config} {local}/run {local}/state ib0 ib0" for i in (0, 1)
    ]
