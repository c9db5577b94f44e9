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
    for key, value in (("ProtectSystem", "strict"), ("ProtectHome", "yes"), ("PrivateTmp", "yes"),
                       ("NoNewPrivileges", "yes"), ("CapabilityBoundingSet", ""), ("UMask", "0077"),
                       ("RuntimeDirectoryMode", "0700"), ("StateDirectoryMode", "0700")):
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
    r = subprocess.run(["systemd-analyze", "security", "--offline=true", str(UNIT)], capture_output=True,
                       text=True, timeout=120, check=False)
    m = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?)", r.stdout + r.stderr)
    assert m, f"no exposure level in the output (exit {r.returncode}):\n{r.stdout}\n{r.stderr}"
    assert float(m.group(1)) <= MAX_EXPOSURE, r.stdout
