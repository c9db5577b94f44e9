"""The trainer group's meeting point and its commands, hosted by the daemon (SPEC §12.1).

Store layout (every key under a secret; one prefix per group generation):

* ``<secret>/generation``: the current generation, set by the daemon before it starts ranks;
* ``<secret>/g<generation>/``: that generation's prefix (``store_keys``), under which the ranks
  meet: ``arrived/<rank>``, ``joined/<rank>`` (the join check, ``joined``), torch's own
  rendezvous keys, and ``cmd/<seq>``: rank 0's commands, one per key (``COMMANDS_KEPT`` kept).

The store itself has no authentication, and its keys are readable by anyone who reaches it
(``list_keys``): nothing read from it is trusted. A command is typed data (:class:`Command`),
encoded as JSON and signed with an HMAC under a key each rank gets from the daemon privately
(``ATROPOSD_TRAINER_KEY`` in its environment, never a store key, never argv); the MAC binds the
generation's prefix and the command's sequence number, so a value written by anyone else, or
replayed from another generation or another position, is refused (:class:`BadCommand`). Nothing
a rank receives is unpickled.

Where the store is (``GroupStore``): with every rank on this machine (no port given), a c10d
FileStore in a private directory (mode 0700, made for the store; each file 0600), one file per
group generation — a (re)formed group gets a fresh file and the previous one is removed; the
directory goes when the store closes (the daemon's, in its runtime directory: one a killed daemon
left goes when the next store is made). Only this user can reach it: the ranks find it by its path
(``address``). A FileStore only grows (a deleted key is one more record), so rank 0's commands do
not go through it on one machine: they are files of their own in a directory beside the
generation's store file (:class:`CommandBox`, 0700; each command written whole and renamed into
place, ``COMMANDS_KEPT`` kept), so that what the group holds does not grow with the steps — the
store file keeps only the rendezvous. ``GroupStore.size_bytes`` (``status --json``:
``trainer.group_store_bytes``) says how much it holds. With several machines (a port given), a
TCPStore on a socket the daemon binds itself and hands over (``master_listen_fd``): a TCPStore
given 127.0.0.1 would otherwise listen on every interface; a deleted key's memory goes back.

Several machines: the head's launch nonce (``launch``, carried to every node in the signed
``ranks`` start message) is part of the store prefix and of the command key
(:func:`launch_secret`, :func:`launch_key`): a command recorded in one launch of the head never
verifies in the next, where generations start at 1 again.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import os
import secrets
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from torch.distributed import Store

__all__ = [
    "COMMANDS_KEPT",
    "KEY_VAR",
    "Apply",
    "BadCommand",
    "Canary",
    "Checkpoint",
    "Command",
    "Compute",
    "Discard",
    "Gather",
    "GroupStore",
    "Push",
    "Reload",
    "Score",
    "Stop",
    "command_key",
    "connect_store",
    "decode_command",
    "encode_command",
    "generation_key",
    "key_from_env",
    "launch_key",
    "launch_secret",
    "store_keys",
]

# The store's own timeout for a get or wait by the daemon's side (joins have their own deadline).
STORE_TIMEOUT_S = 600.0
# Command keys left in the store (older ones are deleted: a long run does not fill it).
COMMANDS_KEPT = 8
# One machine: the store's private directory is named with this prefix.
STORE_DIR_PREFIX = "atroposd-trainer-store-"
# The rank's command key (hex), in its environment.
KEY_VAR = "ATROPOSD_TRAINER_KEY"
_MAC_LEN = 64  # hex SHA-256
_MAX_COMMAND_BYTES = 1 << 24


def generation_key(secret: str) -> str:
    """The store key holding the current group generation (set by the daemon before it starts ranks)."""
    return f"{secret}/generation"


def store_keys(secret: str, generation: int) -> str:
    """The store prefix of one group generation (every (re)formed group has a fresh one)."""
    return f"{secret}/g{generation}/"


def command_key(seq: int) -> str:
    """The key (under a generation's prefix) of rank 0's ``seq``-th command."""
    return f"cmd/{seq}"


def launch_secret(secret: str, launch: str) -> str:
    """The store secret of one launch of the head (``launch``: its nonce; "" leaves it as is)."""
    return f"{secret}/l{launch}" if launch else secret


def launch_key(key: bytes, launch: str) -> bytes:
    """The command key of one launch of the head: HMAC-SHA256 of the launch under the group's
    key ("" leaves it as is)."""
    if not launch:
        return key
    return hmac.new(key, b"atroposd trainer launch\n" + launch.encode(), hashlib.sha256).digest()


def key_from_env(environ: dict[str, str] | Any) -> bytes:
    """The rank's command key from its environment (``KEY_VAR``, hex); ValueError when absent."""
    text = str(environ.get(KEY_VAR, ""))
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) < 16:
        raise ValueError(f"{KEY_VAR} must hold the trainer group's key (hex, at least 16 bytes)")
    return key


class BadCommand(ValueError):
    """A store value that is not a command of rank 0 for this position (forged, replayed, malformed)."""


# ---------------------------------------------------------------------------- commands


def _str(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise BadCommand(f"{what} must be a string")
    return value


def _int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadCommand(f"{what} must be an integer")
    return value


def _only(args: dict[str, Any], names: set[str], op: str) -> None:
    extra = set(args) - names
    if extra:
        raise BadCommand(f"{op}: unknown argument(s) {sorted(extra)}")


@dataclass(frozen=True)
class Compute:
    """Run this rank's share of a step (the share follows on the process group). ``capture`` > 0:
    the passes' logprobs are π_old of a batch of that many flat positions, summed over the ranks
    (several optimizer steps per batch, SPEC §14)."""

    op: ClassVar[str] = "compute"
    capture: int = 0

    def args(self) -> dict[str, Any]:
        return {"capture": self.capture} if self.capture else {}

    @classmethod
    def parse(cls, args: dict[str, Any]) -> Compute:
        _only(args, {"capture"}, cls.op)
        capture = _int(args.get("capture", 0), "compute: capture")
        if capture < 0:
            raise BadCommand("compute: capture out of range")
        return cls(capture)


@dataclass(frozen=True)
class Score:
    """Score this rank's share without gradients: π_old of a batch of ``size`` flat positions,
    summed over the ranks (the share follows on the process group; SPEC §14)."""

    op: ClassVar[str] = "score"
    size: int

    def args(self) -> dict[str, Any]:
        return {"size": self.size}

    @classmethod
    def parse(cls, args: dict[str, Any]) -> Score:
        _only(args, {"size"}, cls.op)
        size = _int(args.get("size"), "score: size")
        if size < 0:
            raise BadCommand("score: size out of range")
        return cls(size)


@dataclass(frozen=True)
class Apply:
    """Take the optimizer step."""

    op: ClassVar[str] = "apply"

    def args(self) -> dict[str, Any]:
        return {}

    @classmethod
    def parse(cls, args: dict[str, Any]) -> Apply:
        _only(args, set(), cls.op)
        return cls()


@dataclass(frozen=True)
class Discard:
    """Discard the step's gradients."""

    op: ClassVar[str] = "discard"

    def args(self) -> dict[str, Any]:
        return {}

    @classmethod
    def parse(cls, args: dict[str, Any]) -> Discard:
        _only(args, set(), cls.op)
        return cls()


@dataclass(frozen=True)
class Stop:
    """Leave the group and exit 0."""

    op: ClassVar[str] = "stop"

    def args(self) -> dict[str, Any]:
        return {}

    @classmethod
    def parse(cls, args: dict[str, Any]) -> Stop:
        _only(args, set(), cls.op)
        return cls()


@dataclass(frozen=True)
class Push:
    """The gather is bucket ``index`` of ``count`` of a push of ``version`` (SPEC §12.3)."""

    index: int
    count: int
    version: int

    @classmethod
    def parse(cls, value: object) -> Push:
        if not isinstance(value, dict) or set(value) != {"index", "count", "version"}:
            raise BadCommand("gather: push must be {index, count, version}")
        push = cls(
            _int(value["index"], "push.index"),
            _int(value["count"], "push.count"),
            _int(value["version"], "push.version"),
        )
        if not 0 <= push.index < push.count or push.version < 0:
            raise BadCommand("gather: push out of range")
        return push


@dataclass(frozen=True)
class Gather:
    """Gather the full tensors ``names`` (collectives); a node's first rank feeds its replicas."""

    op: ClassVar[str] = "gather"
    names: tuple[str, ...]
    push: Push | None = None

    def args(self) -> dict[str, Any]:
        push = (
            None
            if self.push is None
            else {"index": self.push.index, "count": self.push.count, "version": self.push.version}
        )
        return {"names": list(self.names), "push": push}

    @classmethod
    def parse(cls, args: dict[str, Any]) -> Gather:
        _only(args, {"names", "push"}, cls.op)
        names = args.get("names")
        if not isinstance(names, list):
            raise BadCommand("gather: names must be a list")
        push = args.get("push")
        return cls(tuple(_str(n, "gather: a name") for n in names), None if push is None else Push.parse(push))


@dataclass(frozen=True)
class Reload:
    """A node's first rank has its replicas load ``version`` from ``path`` (shared file system)."""

    op: ClassVar[str] = "reload"
    path: str
    version: int

    def args(self) -> dict[str, Any]:
        return {"path": self.path, "version": self.version}

    @classmethod
    def parse(cls, args: dict[str, Any]) -> Reload:
        _only(args, {"path", "version"}, cls.op)
        return cls(_str(args.get("path"), "reload: path"), _int(args.get("version"), "reload: version"))


@dataclass(frozen=True)
class Checkpoint:
    """Write this rank's shards of a checkpoint into ``path``: from a copy, on the rank's
    background thread (``background``), or at once from its live tensors."""

    op: ClassVar[str] = "checkpoint"
    path: str
    background: bool = True

    def args(self) -> dict[str, Any]:
        return {"path": self.path, "background": self.background}

    @classmethod
    def parse(cls, args: dict[str, Any]) -> Checkpoint:
        _only(args, {"path", "background"}, cls.op)
        background = args.get("background", True)
        if not isinstance(background, bool):
            raise BadCommand("checkpoint: background must be true or false")
        return cls(_str(args.get("path"), "checkpoint: path"), background)


@dataclass(frozen=True)
class Canary:
    """Score the sentinel's canary with every rank (the pairs follow as a broadcast; SPEC §15)."""

    op: ClassVar[str] = "canary"

    def args(self) -> dict[str, Any]:
        return {}

    @classmethod
    def parse(cls, args: dict[str, Any]) -> Canary:
        _only(args, set(), cls.op)
        return cls()


Command = Compute | Score | Apply | Discard | Stop | Gather | Reload | Checkpoint | Canary
_PARSERS: dict[str, Any] = {
    c.op: c.parse for c in (Compute, Score, Apply, Discard, Stop, Gather, Reload, Checkpoint, Canary)
}


def _mac(key: bytes, prefix: str, seq: int, body: bytes) -> str:
    return hmac.new(key, f"{prefix}\n{seq}\n".encode() + body, hashlib.sha256).hexdigest()


def encode_command(command: Command, *, key: bytes, prefix: str, seq: int) -> bytes:
    """The store value of rank 0's ``seq``-th command of the generation at ``prefix``:
    ``<hex HMAC>.<JSON>``, the MAC over the prefix, the sequence number and the JSON."""
    body = json.dumps({"seq": seq, "op": command.op, "args": command.args()}, separators=(",", ":")).encode()
    return _mac(key, prefix, seq, body).encode() + b"." + body


def decode_command(value: bytes, *, key: bytes, prefix: str, seq: int) -> Command:
    """The command in a store value, checked: its MAC (under ``key``, for this ``prefix`` and
    ``seq``), then its JSON, op and arguments. :class:`BadCommand` otherwise."""
    if not isinstance(value, bytes | bytearray) or len(value) > _MAX_COMMAND_BYTES:
        raise BadCommand("not a command (type or size)")
    mac, dot, body = bytes(value).partition(b".")
    if not dot or len(mac) != _MAC_LEN:
        raise BadCommand("not a command (no MAC)")
    if not hmac.compare_digest(mac, _mac(key, prefix, seq, body).encode()):
        raise BadCommand(f"command {seq}: bad MAC (not written by rank 0 of this generation)")
    try:
        data = json.loads(body)
    except ValueError as exc:
        raise BadCommand(f"command {seq}: not JSON") from exc
    if not isinstance(data, dict) or set(data) != {"seq", "op", "args"} or data["seq"] != seq:
        raise BadCommand(f"command {seq}: malformed")
    parse = _PARSERS.get(data["op"]) if isinstance(data["op"], str) else None
    if parse is None:
        raise BadCommand(f"command {seq}: unknown op {data['op']!r}")
    if not isinstance(data["args"], dict):
        raise BadCommand(f"command {seq}: args must be an object")
    command: Command = parse(data["args"])
    return command


# ---------------------------------------------------------------------------- commands on one machine

COMMANDS_DIR_SUFFIX = ".cmd"  # beside a generation's store file: its commands
_POLL_FIRST_S, _POLL_S = 0.001, 0.01  # a waiting rank looks this often (the first 0.1 s, then)


class CommandBox:
    """Rank 0's commands on one machine, as files in a private directory beside the generation's
    store file: the few store methods the ranks use for commands (``set``, ``get``, ``wait``,
    ``check``, ``delete_key``). A command is written to a file of its own and renamed into place
    (a reader never sees half of one); a deleted one is gone, so the directory holds at most
    ``COMMANDS_KEPT`` commands, however long the run. A rank whose directory is gone (the group
    re-formed or closed) gets an error, not a wait."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)

    def _path(self, key: str) -> Path:
        name = key.replace("/", "-")
        if not name.replace("-", "").isalnum():
            raise ValueError(f"not a command key: {key!r}")
        return self.directory / name

    def _gone(self) -> RuntimeError:
        return RuntimeError(f"the trainer group's commands {self.directory} are gone (the group re-formed or closed)")

    def set(self, key: str, value: bytes | str) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        path = self._path(key)
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileNotFoundError:
            raise self._gone() from None
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        os.replace(tmp, path)

    def get(self, key: str) -> bytes:
        try:
            fd = os.open(self._path(key), os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            if not self.directory.is_dir():
                raise self._gone() from None
            raise KeyError(key) from None
        try:
            with os.fdopen(fd, "rb") as f:
                return f.read(_MAX_COMMAND_BYTES + 1)
        except BaseException:
            raise

    def check(self, keys: list[str]) -> bool:
        if not self.directory.is_dir():
            raise self._gone()
        return all(self._path(k).exists() for k in keys)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        """Until every key is there; a RuntimeError naming the timeout when ``timeout`` passes."""
        start = time.monotonic()
        limit = timeout.total_seconds() if timeout is not None else STORE_TIMEOUT_S
        while not self.check(keys):
            waited = time.monotonic() - start
            if waited > limit:
                raise RuntimeError(f"Wait timeout after {limit:g} s for {keys}")
            time.sleep(_POLL_FIRST_S if waited < 0.1 else _POLL_S)

    def delete_key(self, key: str) -> bool:
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            return False
        return True

    def size_bytes(self) -> int:
        try:
            return sum(e.stat().st_size for e in os.scandir(self.directory))
        except OSError:
            return 0


def command_box(address: str) -> CommandBox | None:
    """The commands of the generation whose store is at ``address`` (a file: one machine), or
    None (host:port: several machines, where commands go through the TCPStore)."""
    return CommandBox(address + COMMANDS_DIR_SUFFIX) if address.startswith("/") else None


# ---------------------------------------------------------------------------- the store


@dataclass
class GroupStore:
    """The daemon's side of the store: generations, the join check, and the group's key.

    No ``port`` and no ``advertise`` (every rank on this machine): a FileStore per generation in a
    private directory made under ``directory`` (the system's temporary directory by default).
    A ``port`` (several machines): the TCPStore on ``host``:``port``."""

    secret: str
    world: int
    host: str = "127.0.0.1"
    port: int = 0
    advertise: str | None = None
    # the ranks' command key: given (several machines: derived from the cluster token) or fresh
    key: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False)
    # one machine: where the store's private directory is made (the daemon: its runtime directory,
    # where a directory left by a killed daemon is removed first)
    directory: str | Path | None = None
    # several machines: the head's launch nonce, in the prefix and the key (launch_secret, launch_key)
    launch: str = ""
    store: Store | None = field(init=False, default=None, repr=False)
    generation: int = field(init=False, default=0)
    # one machine: the private directory and the current generation's file
    private_dir: Path | None = field(init=False, default=None)
    path: Path | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.secret = launch_secret(self.secret, self.launch)
        self.key = launch_key(self.key, self.launch)
        if self.local:
            if self.directory is not None:  # the daemon's own directory: a killed daemon's store goes now
                for stale in Path(self.directory).glob(STORE_DIR_PREFIX + "*"):
                    shutil.rmtree(stale, ignore_errors=True)
            self.private_dir = Path(tempfile.mkdtemp(prefix=STORE_DIR_PREFIX, dir=self.directory))
            return
        import torch.distributed as dist

        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        host = self.host if self.host != "0.0.0.0" else ""
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, self.port))
            sock.listen(256)
            # the address the ranks connect to: the bound host, or (a wildcard bind) ``advertise``
            self.host, self.port = self.advertise or host or "127.0.0.1", int(sock.getsockname()[1])
            self.store = dist.TCPStore(
                self.host,
                self.port,
                is_master=True,
                master_listen_fd=sock.fileno(),
                wait_for_workers=False,
                use_libuv=False,
                timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S),
            )
        except BaseException:
            sock.close()
            raise
        # The store's server owns the listening socket now: closing it under the server's poll
        # would abort the process. It goes with the store (at the latest, with this process).
        sock.detach()

    @property
    def local(self) -> bool:
        """Every rank on this machine: the store is a file only this user can reach."""
        return self.port == 0 and self.advertise is None

    @property
    def address(self) -> str:
        """Where the ranks find the store: the current generation's file (one machine), or
        ``host:port``."""
        if self.local:
            if self.path is None:
                raise RuntimeError("the trainer group's store has no generation yet (next_generation)")
            return str(self.path)
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def next_generation(self) -> str:
        """Start a new group generation; returns its store prefix. One machine: in a fresh file,
        the previous generation's removed."""
        self.generation += 1
        if self.local:
            self._next_file()
        if self.store is None:
            raise RuntimeError("the trainer group's store is closed")
        self.store.set(generation_key(self.secret), str(self.generation))
        return store_keys(self.secret, self.generation)

    def _next_file(self) -> None:
        import torch.distributed as dist

        if self.private_dir is None:
            raise RuntimeError("the trainer group's store is closed")
        path = self.private_dir / f"g{self.generation}"
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))  # ours, before torch opens it
        os.mkdir(str(path) + COMMANDS_DIR_SUFFIX, 0o700)  # its commands (CommandBox)
        store = dist.FileStore(str(path), -1)
        store.set_timeout(datetime.timedelta(seconds=STORE_TIMEOUT_S))
        old, self.store, self.path = self.path, store, path
        if old is not None:
            old.unlink(missing_ok=True)
            shutil.rmtree(str(old) + COMMANDS_DIR_SUFFIX, ignore_errors=True)

    def commands(self) -> CommandBox | None:
        """Where rank 0 writes its commands: the current generation's :class:`CommandBox` (one
        machine), None with several machines (the TCPStore under the generation's prefix)."""
        return command_box(str(self.path)) if self.local and self.path is not None else None

    def size_bytes(self) -> int | None:
        """What the store holds on disk (one machine: the generation's file and its commands);
        None with several machines (the TCPStore is in memory)."""
        if not self.local or self.path is None:
            return None
        try:
            size = os.stat(self.path).st_size
        except OSError:
            return 0
        return size + CommandBox(str(self.path) + COMMANDS_DIR_SUFFIX).size_bytes()

    def joined(self, rank: int) -> bool:
        """Has ``rank`` joined the current generation's process group?"""
        return joined(self.store, self.secret, self.generation, rank)

    def close(self) -> None:
        self.store = None
        self.path = None
        if self.private_dir is not None:
            shutil.rmtree(self.private_dir, ignore_errors=True)
            self.private_dir = None


def connect_store(address: str, timeout: float) -> Store:
    """A rank's client of the group's store at ``address`` (a generation's file, or host:port)."""
    import torch.distributed as dist

    if address.startswith("/"):
        if not os.path.isfile(address):  # the group was re-formed or closed meanwhile
            raise FileNotFoundError(f"the trainer group's store {address} is gone")
        store = dist.FileStore(address, -1)
        store.set_timeout(datetime.timedelta(seconds=timeout))
        return store
    host, _, port = address.rpartition(":")
    return dist.TCPStore(
        host.strip("[]"), int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout), use_libuv=False
    )


def joined(store: Store | None, secret: str, generation: int, rank: int) -> bool:
    """The join check, the head's and every node's: ``rank`` marked itself joined under
    ``generation``'s prefix (a readiness signal only: it starts nothing). False while there is no
    store; a store that cannot be asked is an error naming the rank and the generation (the
    rank's readiness probe fails with it)."""
    import torch.distributed as dist

    if store is None:
        return False
    try:
        scoped = dist.PrefixStore(store_keys(secret, generation), store)
        return bool(scoped.check([f"joined/{rank}"]))
    except Exception as exc:
        raise RuntimeError(
            f"the join check of trainer rank {rank} (group generation {generation}) could not read the "
            f"group's store: {type(exc).__name__}: {exc}"
        ) from exc
