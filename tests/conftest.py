"""Shared fixtures.  Every test runs under a leak check: no process it started, no shared-memory
segment of atroposd and no listening socket of its own may outlive it."""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--fuzz-seed",
        default=None,
        help="replay the fuzz suites with this seed (printed in the report header of every run)",
    )


def pytest_configure(config: pytest.Config) -> None:
    seed = config.getoption("--fuzz-seed")
    if seed is not None:
        os.environ["ATROPOSD_FUZZ_SEED"] = str(seed)
    from tests import fuzzseed  # noqa: F401  (draws the run's seed into the environment: every worker shares it)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A ``gpu`` test skips, saying so, where torch sees no CUDA device (``-m gpu`` on a CPU
    machine reports skips, not failures)."""
    gpu = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in gpu:
        item.add_marker(skip)


def pytest_report_header(config: pytest.Config) -> str:
    from tests import fuzzseed

    return fuzzseed.replay_hint()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    from tests import fuzzseed

    if terminalreporter.stats.get("failed"):
        terminalreporter.write_line(fuzzseed.replay_hint())


# Every process a test starts inherits this marker, so escaped grandchildren are found too.
# Under pytest-xdist (scripts/test runs two workers) each worker marks its own: ``<run>.<worker>``,
# and what another worker's tests started (or left in /dev/shm) is theirs to check, not this one's.
# A run a test starts inside this one (tests/test_leak_check.py) is ``<run>-<name>``: its processes
# are another worker's to this run, and this run's to it.
RUN_MARKER = "ATROPOSD_TEST_RUN"
os.environ.setdefault(RUN_MARKER, uuid.uuid4().hex)
_RUN = os.environ[RUN_MARKER].split(".", 1)[0]
_ROOT = _RUN.split("-", 1)[0]
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _WORKER:
    os.environ[RUN_MARKER] = f"{_RUN}.{_WORKER}"
_MARK = os.environ[RUN_MARKER]


# A process older than this run cannot carry its marker: its environment is not read (the
# check runs around every test, and reading every process's environment is most of its cost).
# The margin covers create_time's granularity (the boot time it is counted from is in seconds).
_RUN_START = time.time() - 2.0
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _young_pids() -> list[int]:
    """The live (not zombie) processes started since the run began, from one read of
    ``/proc/PID/stat`` each: a fraction of psutil's cost for every process (its uids and
    create_time read two files, and a Process object each), which the check pays twice a test."""
    since = (_RUN_START - psutil.boot_time()) * _CLOCK_TICKS
    me = os.getpid()
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            fd = os.open(f"/proc/{name}/stat", os.O_RDONLY)
            try:
                data = os.read(fd, 2048)
            finally:
                os.close(fd)
        except OSError:
            continue  # gone meanwhile
        # after the command's closing parenthesis: state (field 3) ... starttime (field 22)
        fields = data[data.rfind(b")") + 2 :].split(maxsplit=20)
        if len(fields) > 19 and fields[0] != b"Z" and int(fields[19]) >= since:
            out.append(int(name))
    return out


def run_processes() -> Iterator[tuple[psutil.Process, dict[str, str]]]:
    """This user's live processes started since the run began, each with its environment."""
    uid = os.getuid()
    for pid in _young_pids():
        try:
            proc = psutil.Process(pid)
            if proc.uids().real != uid:
                continue
            env = proc.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            continue
        yield proc, env


def kill_left(
    find: Callable[[], list[psutil.Process]], *, within: float = 5.0, poll: float = 0.1, width: int = 120
) -> list[str]:
    """Wait up to ``within`` for ``find()`` to come back empty; kill what it still finds then.
    Each killed process described as ``pid command line`` (cut to ``width``)."""
    deadline = time.monotonic() + within
    while (found := find()) and time.monotonic() < deadline:
        time.sleep(poll)
    left = []
    for proc in found:
        try:
            left.append(f"{proc.pid} {' '.join(proc.cmdline())[:width]}")
            proc.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass
    return left


def _marked_processes() -> list[psutil.Process]:
    found = []
    for proc, env in run_processes():
        try:
            if env.get(RUN_MARKER) == _MARK and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            continue
    return found


def _other_workers() -> tuple[set[int], set[str]]:
    """The pids and atroposd instance nonces (``ATROPOSD_INSTANCE``) of the processes the other
    workers' tests started: the segments named after them are theirs (empty when not under xdist)."""
    pids: set[int] = set()
    nonces: set[str] = set()
    if not _WORKER:
        return pids, nonces
    for proc, env in run_processes():
        mark = env.get(RUN_MARKER, "")
        if mark.split(".", 1)[0].split("-", 1)[0] != _ROOT or mark == _MARK:
            continue
        pids.add(proc.pid)
        if env.get("ATROPOSD_INSTANCE"):
            nonces.add(env["ATROPOSD_INSTANCE"])
    return pids, nonces


def _not_others(names: set[str]) -> set[str]:
    """``names`` less the segments another worker's live processes own: atroposd's weight segments
    (``atroposd-<nonce>-…``) of their instances and torch's files (``torch_<pid>_…``) of their pids.
    What else they leave on the way (multiprocessing's semaphores) is gone within a moment: a
    segment counts as left behind only when it is still there, unmapped, two seconds on."""
    if not _WORKER or not names:
        return names
    from atroposd.shmscan import OWN_SEGMENT_PREFIX, TORCH_SEGMENT_RE  # a leaf: no torch to import

    deadline = time.monotonic() + 2.0
    while True:
        pids, nonces = _other_workers()
        owners = tuple(f"{OWN_SEGMENT_PREFIX}{nonce}-" for nonce in nonces)
        left = set()
        for name in names:
            torch_file = TORCH_SEGMENT_RE.match(name)
            if name.startswith(owners) or (torch_file is not None and int(torch_file.group(1)) in pids):
                continue
            left.add(name)
        left = _unmapped({n for n in left if os.path.exists(f"/dev/shm/{n}")})
        if not left or time.monotonic() >= deadline:
            return left
        names = left
        time.sleep(0.2)


def _shm_segments() -> set[str]:
    """Every name in /dev/shm: atroposd's weight segments, and what children leave (vLLM's
    ``psm_*`` message queues, multiprocessing's ``sem.mp-*``)."""
    try:
        return set(os.listdir("/dev/shm"))
    except FileNotFoundError:
        return set()


def _unmapped(names: set[str]) -> set[str]:
    """The segments no live process maps: a segment some process still maps belongs to a job that
    is running (possibly not this test's: tests may share the machine with a real job)."""
    if not names:
        return set()  # nothing to look up: every process's maps are not read for nothing
    from atroposd.shmscan import mapped_shm  # a leaf: no torch to import for the check

    in_use = mapped_shm(prefix="")
    return {n for n in names if n not in in_use}


@pytest.fixture(scope="session", autouse=True)
def builtin_model_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Jobs' configs copy builtin:tiny from here, built once (tests/e2e/jobs.job_config)."""
    from tests.e2e import jobs

    jobs.MODEL_CACHE = tmp_path_factory.mktemp("builtin-models")
    yield
    jobs.MODEL_CACHE = None


@pytest.fixture(scope="session", autouse=True)
def no_leaks_at_the_end() -> Iterator[None]:
    """What no test's own check sees: the segments that module- and session-scoped servers
    leave when they stop, after the last test's check (a vLLM engine's ``psm_*`` queues and
    multiprocessing's ``sem.mp-*`` semaphores, say). Fails the run's last test."""
    before = _shm_segments()
    start = time.time()
    yield
    left: set[str] = set()
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:  # a stopping child's own clean-up may still be running
        left = _not_others({n for n in _unmapped(_shm_segments() - before) if _created_since(n, start)})
        if not left:
            return
        time.sleep(0.1)
    for name in left:
        try:
            os.unlink(f"/dev/shm/{name}")
        except OSError:
            pass
    pytest.fail(f"shared-memory segments left behind by the run: {sorted(left)}", pytrace=False)


def _created_since(name: str, start: float) -> bool:
    try:
        return os.stat(f"/dev/shm/{name}").st_ctime >= start - 0.05
    except OSError:
        return False


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small model that speaks tools (tests/models/toolmodel.py: byte-level BPE, a Hermes-style
    chat template, fine-tuned for a few seconds), built once per test run."""
    from tests.models.toolmodel import ensure_tool_model

    return ensure_tool_model(tmp_path_factory.getbasetemp() / "tool-model")


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a test that leaves a process or a shared-memory segment behind."""
    before_shm = _shm_segments()
    before = {p.pid for p in _marked_processes()}
    yield
    descr = kill_left(lambda: [p for p in _marked_processes() if p.pid not in before], poll=0.05, width=160)
    new_shm = _not_others(_unmapped(_shm_segments() - before_shm))
    for name in new_shm:
        try:
            os.unlink(f"/dev/shm/{name}")
        except OSError:
            pass
    problems = []
    if descr:
        problems.append("processes left behind:\n  " + "\n  ".join(descr))
    if new_shm:
        problems.append(f"shared-memory segments left behind: {sorted(new_shm)}")
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short temporary directory (Unix socket paths must fit in 107 bytes)."""
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="apd-", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)
