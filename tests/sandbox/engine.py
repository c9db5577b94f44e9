"""A real container engine for the tests: podman's Docker-compatible service (Debian's podman and
runc), with its own storage, run directory and configuration under a temporary directory, and a
busybox image built locally (no registry is reachable).

On this kind of machine podman runs containers when its configuration sets runc, cgroupfs, a
ulimit within the machine's hard limits and no network namespace of its own (crun refuses the
cgroup layout; the default ulimits exceed the hard ones)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

IMAGE = "localhost/atroposd-test-busybox:1"
BUSYBOX = ("/bin/busybox", "/usr/bin/busybox")

CONTAINERS_CONF = """\
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=1000:1000"]
netns = "none"
log_driver = "k8s-file"

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "none"
tmp_dir = "{tmp}/libpod-tmp"
volume_path = "{tmp}/volumes"

[network]
network_config_dir = "{tmp}/networks"
"""


def missing() -> str | None:
    """Why no engine can be had here (None: podman, runc and a static busybox are installed)."""
    if shutil.which("podman") is None:
        return "podman is not installed (scripts/setup-sandbox installs podman, runc and busybox-static)"
    if shutil.which("runc") is None:
        return "runc is not installed (scripts/setup-sandbox)"
    busybox = _busybox()
    if busybox is None:
        return "no busybox to build the test image from (apt-get install busybox-static)"
    linked = subprocess.run(["ldd", busybox], capture_output=True, text=True)
    if "not a dynamic executable" not in linked.stdout + linked.stderr:
        return f"{busybox} is linked dynamically: the test image needs busybox-static (scripts/setup-sandbox)"
    return None


def _busybox() -> str | None:
    for path in BUSYBOX:
        if os.path.exists(path):
            return path
    return None


def busybox_rootfs(dest: Path) -> Path:
    """A root filesystem tarball: the static busybox and a link for each of its applets."""
    src = _busybox()
    assert src is not None
    applets = subprocess.run([src, "--list"], capture_output=True, text=True, check=True).stdout.split()
    tar_path = dest / "rootfs.tar"
    with tarfile.open(tar_path, "w") as tar:
        for d in ("bin", "tmp", "etc", "proc", "sys", "dev"):
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o1777 if d == "tmp" else 0o755
            tar.addfile(info)
        tar.add(src, arcname="bin/busybox")
        for name in applets:
            if name != "busybox":
                info = tarfile.TarInfo(f"bin/{name}")
                info.type, info.linkname = tarfile.SYMTYPE, "busybox"
                tar.addfile(info)
    return tar_path


@dataclass
class Podman:
    """One podman service of a test module's own."""

    dir: Path
    proc: subprocess.Popen[bytes] | None = None
    # vfs: a copy of the image per container, nothing mounted that could outlive the service
    driver: str = "vfs"

    @property
    def socket(self) -> Path:
        return self.dir / "podman.sock"

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "CONTAINERS_CONF": str(self.dir / "containers.conf")}

    def podman(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        argv = ["podman", "--root", str(self.dir / "storage"), "--runroot", str(self.dir / "runroot")]
        argv += ["--storage-driver", self.driver, *args]
        return subprocess.run(argv, env=self.env, capture_output=True, text=True, check=check, timeout=timeout)

    def start(self) -> None:
        (self.dir / "containers.conf").write_text(CONTAINERS_CONF.format(tmp=self.dir))
        tar = busybox_rootfs(self.dir)
        self.podman("import", "--change", "ENV=PATH=/bin", str(tar), IMAGE)
        argv = ["podman", "--root", str(self.dir / "storage"), "--runroot", str(self.dir / "runroot")]
        argv += ["--storage-driver", self.driver, "system", "service", "--time", "0", self.url]
        log = open(self.dir / "service.log", "wb")  # the service's own log
        self.proc = subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"podman system service exited: {(self.dir / 'service.log').read_text()[-2000:]}")
            if self.socket.exists():
                try:
                    with socket.socket(socket.AF_UNIX) as s:
                        s.connect(str(self.socket))
                    return
                except OSError:
                    pass
            time.sleep(0.05)
        raise RuntimeError("podman system service did not listen within 30 s")

    def containers(self, *filters: str) -> list[dict[str, object]]:
        """Every container (``podman ps -a``), optionally ``label=k=v`` filtered."""
        args = ["ps", "-a", "--format", "json"]
        for f in filters:
            args += ["--filter", f]
        return list(json.loads(self.podman(*args).stdout or "[]"))

    def stop(self) -> None:
        """Every container removed, the service stopped by its pid, its files removed."""
        try:
            self.podman("rm", "-a", "-f", "-t", "0", check=False)
            self.podman("volume", "rm", "-a", "-f", check=False)
        finally:
            if self.proc is not None and self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(15)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(5)
            self._stop_monitors()
            shutil.rmtree(self.dir, ignore_errors=True)

    def _stop_monitors(self) -> None:
        """The service's conmon monitors: each exec session's waits 300 s after the exec ends
        (podman keeps its exit status), detached from the service. Found by this service's own
        directory in their command lines, stopped by pid."""
        import psutil

        mine = []
        for proc in psutil.process_iter(["pid", "cmdline"]):
            try:
                if any(str(self.dir) in arg for arg in proc.info["cmdline"] or []):
                    mine.append(proc)
            except (psutil.Error, TypeError):
                continue
        for proc in mine:
            try:
                proc.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(mine, timeout=5)
