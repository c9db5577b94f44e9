"""Where a job's files live, derived from the config (see docs/ARCHITECTURE.md, "Files")."""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from atroposd.config import Config, fallback_runtime_dir

# A component: daemon, api, inference, trainer, or an environment replica (NAME-i). One path
# component that cannot climb: no '/', and no leading '.'.
COMPONENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


@dataclass(frozen=True)
class Paths:
    runtime_dir: Path
    state_dir: Path
    #: runtime_dir is the /tmp fallback (a directory every user may write): checked strictly
    runtime_dir_is_fallback: bool = False
    #: ``daemon.socket_group``: its members may reach the control socket (runtime_dir 0710)
    socket_group: str = ""
    #: ``[trainer] checkpoint_dir`` when set (None: ``{state_dir}/checkpoints``)
    checkpoint_dir: Path | None = None
    #: several machines: ``reload`` writes where every node sees it (under checkpoint_dir)
    shared_sync: bool = False

    @classmethod
    def of(cls, cfg: Config) -> Paths:
        return cls(
            cfg.runtime_dir,
            cfg.state_dir,
            cfg.runtime_dir == fallback_runtime_dir(),
            cfg.daemon.socket_group,
            cfg.checkpoint_dir,
            cfg.cluster.enabled,
        )

    def ensure_state_dirs(self) -> None:
        """``state_dir`` and its ``logs`` and ``recovery`` directories, each created 0700 (whatever
        the umask; existing ones are left as they are)."""
        for d in (self.state_dir, self.logs_dir, self.recovery_dir):
            make_private_dir(d)

    def ensure_runtime_dir(self) -> None:
        """Create or check runtime_dir before anything is put there (see ``ensure_runtime_dir``)."""
        ensure_runtime_dir(self.runtime_dir, fallback=self.runtime_dir_is_fallback, group=self.socket_group)

    # runtime_dir ---------------------------------------------------------------
    @property
    def control_socket(self) -> Path:
        return self.runtime_dir / "control.sock"

    @property
    def pidfile(self) -> Path:
        return self.runtime_dir / "atroposd.pid"

    def inference_socket(self, port: int) -> Path:
        return self.runtime_dir / f"inference-{port}.sock"

    @property
    def weights_dir(self) -> Path:
        return self.runtime_dir / "weights"

    def child_config(self, nonce: str) -> Path:
        return self.runtime_dir / f"config-{nonce}.toml"

    # state_dir -----------------------------------------------------------------
    @property
    def logs_dir(self) -> Path:
        return self.state_dir / "logs"

    def log_file(self, component: str) -> Path:
        """``logs/<component>.log``; ValueError for a name that is not a component's (a path, ``..``)."""
        if not COMPONENT_NAME.fullmatch(component):
            raise ValueError(
                f"{component!r} is not a component name (letters, digits, '.', '_', '-'; no '/', not starting with '.')"
            )
        return self.logs_dir / f"{component}.log"

    @property
    def checkpoints_dir(self) -> Path:
        return self.checkpoint_dir if self.checkpoint_dir is not None else self.state_dir / "checkpoints"

    @property
    def metrics_file(self) -> Path:
        return self.state_dir / "metrics.jsonl"

    @property
    def recovery_dir(self) -> Path:
        return self.state_dir / "recovery"

    @property
    def models_dir(self) -> Path:
        return self.state_dir / "models"

    @property
    def sync_dir(self) -> Path:
        """``reload``'s weights: ``{state_dir}/sync``; with several machines, on the shared file
        system of ``checkpoint_dir`` (``{checkpoint_dir}/sync``), where every node's replicas load."""
        if self.shared_sync:
            return (self.checkpoint_dir or self.checkpoints_dir) / "sync"
        return self.state_dir / "sync"


class RuntimeDirError(Exception):
    """The runtime directory cannot be trusted (not a directory, a symlink, or not ours)."""


def ensure_runtime_dir(path: Path, *, fallback: bool = False, group: str = "") -> None:
    """Create ``runtime_dir`` (mode 0700, parents as needed) or check the one that is there.

    With ``group`` (``daemon.socket_group``) the directory belongs to that group with mode 0710:
    its members may pass through to the control socket (0660) and list or read nothing; every
    other file in it stays 0600.

    Refused with RuntimeDirError (SPEC §13): a symlink or anything but a directory, and a
    directory owned by another user. The ``fallback`` one (``/tmp/atroposd-$UID``, in a
    directory every user may write) is refused unless it is ours with mode exactly 0700:
    someone else may have made it to read our sockets and manifests. Any other of ours
    with looser permissions is set to 0700.
    """
    existed = os.path.lexists(path)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise RuntimeDirError(f"runtime_dir {path} is a symlink; refusing to use it")
    if not stat.S_ISDIR(st.st_mode):
        raise RuntimeDirError(f"runtime_dir {path} is not a directory")
    if st.st_uid != os.geteuid():
        raise RuntimeDirError(
            f"runtime_dir {path} belongs to uid {st.st_uid}, not to us (uid {os.geteuid()}); "
            "remove it or set daemon.runtime_dir"
        )
    mode = stat.S_IMODE(st.st_mode)
    want = 0o700
    if group:
        import grp

        try:
            gid = grp.getgrnam(group).gr_gid
        except KeyError:
            raise RuntimeDirError(f"daemon.socket_group: no such group {group!r}") from None
        if st.st_gid != gid:
            try:
                os.chown(path, -1, gid, follow_symlinks=False)
            except OSError as exc:
                raise RuntimeDirError(
                    f"runtime_dir {path}: cannot give it to group {group!r} (daemon.socket_group): {exc.strerror}"
                ) from None
        want = 0o710
    if mode != want:
        if fallback and existed and mode != 0o700:
            raise RuntimeDirError(
                f"runtime_dir {path} has mode {mode:04o}, not 0700: someone may have used it; "
                "remove it or set daemon.runtime_dir"
            )
        os.chmod(path, want, follow_symlinks=False)


# Group and others get nothing of what the job creates (state, logs, checkpoints, sockets):
# the shipped unit's UMask=0077, and the same outside systemd (``private_umask``).
PRIVATE_UMASK = 0o077


def private_umask() -> int:
    """Add group and other bits to the process's umask (a stricter one stays); children inherit
    it. Returns the umask before."""
    old = os.umask(PRIVATE_UMASK)
    os.umask(old | PRIVATE_UMASK)
    return old


def make_private_dir(path: Path) -> None:
    """Create ``path`` (parents as needed) with mode 0700 whatever the umask; one that exists is
    left as it is."""
    if not path.is_dir():
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(path, 0o700)


class UnsafeDirError(Exception):
    """A directory whose contents the job would trust is writable by another user."""


def check_checkpoint_dir(path: Path, *, key: str = "trainer.checkpoint_dir") -> None:
    """Create ``path`` 0700 or check the one there (SPEC §12.1): it must be owned by this user
    (or by root) and writable by no one else — whoever can write there chooses what a resume
    loads. Raises UnsafeDirError naming ``key``."""
    try:
        make_private_dir(path)
        st = os.stat(path)
    except OSError as exc:
        raise UnsafeDirError(f"{key}: cannot create {path}: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirError(f"{key}: {path} is not a directory")
    if st.st_uid not in (os.geteuid(), 0):
        raise UnsafeDirError(
            f"{key}: {path} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}): "
            "its owner could plant a checkpoint that the next resume loads"
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:
        who = " and ".join(w for w, bit in (("group", 0o020), ("others", 0o002)) if mode & bit)
        raise UnsafeDirError(
            f"{key}: {path} has mode {mode:04o}, writable by {who}: anyone who can write there "
            f"could plant a checkpoint that the next resume loads; `chmod go-w {path}` "
            "or choose another directory"
        )


def open_nofollow(path: Path, flags: int, mode: int = 0o600) -> int:
    """``os.open`` that never follows a symlink at ``path`` (ELOOP instead): for the pidfile and
    other files the daemon opens in runtime_dir; add ``os.O_EXCL`` for a temporary file."""
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
