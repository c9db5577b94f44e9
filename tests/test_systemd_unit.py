"""The shipped systemd unit runs the daemon unprivileged and sandboxed, keeps the GPUs
reachable, and rates ≤ 4.5 with ``systemd-analyze security`` (where that tool exists)."""

from __future__ import annotations

import configparser
import re
import shutil
import subprocess
from pathlib import Path

import pytest

UNIT = Path(__file__).resolve().parent.parent / "systemd" / "atroposd.service"
MAX_EXPOSURE = 4.5


def _service() -> dict[str, list[str]]:
    """[Service] settings, every value of a repeated key kept (systemd's own parser appends)."""
    out: dict[str, list[str]] = {}
    section = ""
    for raw in UNIT.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line
            continue
        if section == "[Service]":
            key, _, value = line.partition("=")
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def test_runs_as_an_unprivileged_sandboxed_user() -> None:
    svc = _service()
    assert svc.get("DynamicUser") == ["yes"] or svc.get("User", ["root"])[-1] not in ("root", "0")
    for key, value in (
        ("ProtectSystem", "strict"),
        ("ProtectHome", "yes"),
        ("PrivateTmp", "yes"),
        ("NoNewPrivileges", "yes"),
        ("CapabilityBoundingSet", ""),
        ("UMask", "0077"),
        ("RuntimeDirectoryMode", "0700"),
        ("StateDirectoryMode", "0700"),
    ):
        assert svc.get(key, [None])[-1] == value, key
    # the daemon writes only where systemd made room for it
    assert svc["RuntimeDirectory"] == ["atroposd"] and svc["StateDirectory"] == ["atroposd"]


def test_gpus_stay_reachable() -> None:
    """No device sandbox: /dev/nvidia* and /dev/dri stay as they are for any user."""
    svc = _service()
    assert svc.get("PrivateDevices", ["no"])[-1] in ("no", "false")
    assert "DevicePolicy" not in svc and "DeviceAllow" not in svc


def test_unit_parses_as_before() -> None:
    """The existing required settings are still readable by a plain ini parser."""
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.read(UNIT)
    assert parser["Service"]["Type"] == "notify"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_rates_the_unit_at_most_4_5() -> None:
    r = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", str(UNIT)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    m = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?)", r.stdout + r.stderr)
    assert m, f"no exposure level in the output (exit {r.returncode}):\n{r.stdout}\n{r.stderr}"
    assert float(m.group(1)) <= MAX_EXPOSURE, r.stdout


def test_the_tokens_come_as_credentials_of_the_dynamic_user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """LoadCredential= by name (a missing credential is not fatal to the unit), and the daemon
    reads each from $CREDENTIALS_DIRECTORY when its token_file key is empty."""
    from atroposd.config import (
        API_CREDENTIAL,
        CLUSTER_CREDENTIAL,
        ApiConfig,
        ClusterConfig,
        TokenError,
    )

    assert _service()["LoadCredential"] == [CLUSTER_CREDENTIAL, API_CREDENTIAL]
    creds = tmp_path / "credentials"
    creds.mkdir()
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(creds))
    cluster = ClusterConfig(nodes=2, head="127.0.0.1")
    assert cluster.token_path() == "" and ApiConfig().bearer_token() == ""  # none passed: none used
    (creds / CLUSTER_CREDENTIAL).write_text("the-cluster-secret-of-the-job\n")
    (creds / API_CREDENTIAL).write_text("the-api-token-of-the-job\n")
    assert cluster.read_token() == b"the-cluster-secret-of-the-job"
    assert ApiConfig().bearer_token() == "the-api-token-of-the-job"
    assert ApiConfig(token_file=str(creds / CLUSTER_CREDENTIAL)).bearer_token() == "the-cluster-secret-of-the-job"
    (creds / API_CREDENTIAL).write_text("short\n")
    with pytest.raises(TokenError, match="holds 5 bytes"):
        ApiConfig().bearer_token()
