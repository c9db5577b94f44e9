"""The leak check every test runs under (tests/conftest.py), on two pytest-xdist workers as
scripts/test runs it: a test that leaves a process or an unmapped segment behind fails, and the
processes and segments another worker's test holds meanwhile are not blamed on it. An inner run
of four tests, two on each worker, meeting through files so that each check happens while the
other worker's test holds its process and its atroposd segment."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.conftest import RUN_MARKER, kill_left, run_processes
from tests.support import REPO

HOLDER = """
import os, sys, time
from pathlib import Path
# an atroposd-style segment named after this process's instance, unmapped: the daemon's children
# make such names (ATROPOSD_INSTANCE in their environment); removed before it exits
name = "atroposd-" + os.environ["ATROPOSD_INSTANCE"] + "-0011223344556677-0"
fd = os.open("/dev/shm/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
os.ftruncate(fd, 4096)
os.close(fd)
Path(sys.argv[1]).write_text(name)
deadline = time.monotonic() + 120
while not Path(sys.argv[2]).exists() and time.monotonic() < deadline:
    time.sleep(0.05)
os.unlink("/dev/shm/" + name)
"""

HOLDS = """
def test_{order}_{side}_holds_a_process_and_a_segment_while_the_other_checks():
    env = {{**os.environ, "ATROPOSD_INSTANCE": "{side}{nonce}"}}
    argv = [sys.executable, "-c", {holder!r}, str(SYNC / "{side}-held"), str(SYNC / "{side}-release")]
    holder = subprocess.Popen(argv, env=env)
    try:
        wait("{side}-held")
        (SYNC / "{side}-holding").touch()
        wait("{other}-checked")  # the other worker's leaking test ended and was checked meanwhile
    finally:
        (SYNC / "{side}-release").touch()
        holder.wait(30)
"""

LEAKS = """
def test_{order}_{side}_leaks():
    wait("{other}-holding")
    if "{side}" == "a":
        subprocess.Popen(["sleep", "300"])  # left running: the check kills it and fails the test
    else:
        name = "atroposd-{side}{nonce}-8899aabbccddeeff-0"
        fd = os.open("/dev/shm/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.close(fd)  # nobody maps it, nobody removes it: the check removes it and fails the test
"""

HEAD = """
import os, subprocess, sys, time
from pathlib import Path

SYNC = Path(os.environ["LEAK_SYNC_DIR"])


def wait(name):
    deadline = time.monotonic() + 60
    while not (SYNC / name).exists():
        assert time.monotonic() < deadline, f"no {name}"
        time.sleep(0.05)
"""

CHECKED = """
import pytest
from pathlib import Path
import os


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report):
    if report.when == "teardown" and report.nodeid.endswith("_leaks"):
        side = report.nodeid.split("::")[0][len("test_")]
        (Path(os.environ["LEAK_SYNC_DIR"]) / (side + "-checked")).touch()
"""


def _inner_processes(inner: str) -> list[str]:
    """The inner run's processes still alive (killed): none, once it returned."""
    return kill_left(lambda: [proc for proc, env in run_processes() if env.get(RUN_MARKER, "").startswith(inner)])


def test_each_worker_is_blamed_for_its_own_leaks_only(tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    sync = tmp_path / "sync"
    suite.mkdir()
    sync.mkdir()
    nonce = os.urandom(4).hex()
    # worker A holds, then leaks; worker B leaks (while A holds), then holds (while A leaks)
    for side, other, first, second in (("a", "b", HOLDS, LEAKS), ("b", "a", LEAKS, HOLDS)):
        fields = {"side": side, "other": other, "nonce": nonce, "holder": textwrap.dedent(HOLDER)}
        body = textwrap.dedent(HEAD) + "".join(
            textwrap.dedent(t).format(order=order, **fields) for order, t in (("1", first), ("2", second))
        )
        (suite / f"test_{side}.py").write_text(body)
    (suite / "conftest.py").write_text("from tests.conftest import *  # noqa: F403\n")
    (suite / "checked_plugin.py").write_text(textwrap.dedent(CHECKED))
    env = {
        **os.environ,
        "PYTHONPATH": f"{REPO}{os.pathsep}{suite}",
        "LEAK_SYNC_DIR": str(sync),
    }
    # the inner run marks its own processes, as a run inside this one (tests/conftest.py)
    inner = f"{os.environ[RUN_MARKER].split('.', 1)[0]}-inner{os.urandom(4).hex()}"
    env[RUN_MARKER] = inner
    env.pop("PYTEST_XDIST_WORKER", None)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-n",
            "2",
            "--dist",
            "loadfile",
            "-p",
            "checked_plugin",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
            "--rootdir",
            str(suite),
            "-rA",
            str(suite),
        ],
        cwd=suite,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = run.stdout + run.stderr
    left = _inner_processes(inner)
    assert not left, f"the inner run left processes behind: {left}"
    assert run.returncode == 1, out[-4000:]
    assert "PASSED test_a.py::test_1_a_holds_a_process_and_a_segment_while_the_other_checks" in out, out[-4000:]
    assert "PASSED test_b.py::test_2_b_holds_a_process_and_a_segment_while_the_other_checks" in out, out[-4000:]
    # the leaks, each blamed on its own test (an error in its teardown), and nothing else
    assert "processes left behind" in out and "sleep 300" in out, out[-4000:]
    assert f"shared-memory segments left behind: ['atroposd-b{nonce}-8899aabbccddeeff-0']" in out, out[-4000:]
    assert "4 passed, 2 errors" in out, out[-4000:]  # the leaks fail at their teardown
    assert not any(
        n.startswith(f"atroposd-a{nonce}") or n.startswith(f"atroposd-b{nonce}") for n in os.listdir("/dev/shm")
    )
