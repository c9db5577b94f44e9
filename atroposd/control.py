"""The control socket: a Unix stream socket in ``runtime_dir`` speaking framed JSON.

A frame is a 4-byte big-endian length followed by that many bytes of JSON (at most
``MAX_FRAME``).  A connection carries one request ``{"cmd": ..., ...}`` and one answer
``{"ok": bool, ...}``; reading a request has a deadline, so a silent client cannot pin a task.
The socket is 0600 (0660 with ``socket_group``) and the daemon checks every peer's
credentials (SO_PEERCRED): the daemon's user, root, or a member of ``socket_group``.

The client side (``request``) is synchronous and imports nothing heavy: it is what ``atroposd
status`` and friends run.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from atroposd.exitcodes import Exit

if TYPE_CHECKING:
    from anyio.abc import SocketStream, TaskStatus
    from structlog.typing import FilteringBoundLogger

MAX_FRAME = 1 << 20
ANSWER_LIMIT = MAX_FRAME - 4096  # what a handler's answer may take (the envelope has the rest)
READ_TIMEOUT = 10.0
ACCEPT_RETRY_S = 0.1
ACCEPT_LOG_EVERY_S = 10.0  # a failing accept (no descriptors left) is logged at most this often
SEND_TIMEOUT = 10.0  # an answer the client does not read within this is dropped
_LEN = struct.Struct(">I")

Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


class ControlError(Exception):
    """A control request could not be made; ``exit_code`` is the CLI's exit code (SPEC §2)."""

    exit_code: Exit = Exit.RUNTIME


class NotRunning(ControlError):
    exit_code = Exit.NOT_RUNNING


class PermissionDenied(ControlError):
    exit_code = Exit.RUNTIME


class ProtocolError(ControlError):
    exit_code = Exit.RUNTIME


def encode(obj: dict[str, Any]) -> bytes:
    body = orjson.dumps(obj)
    if len(body) > MAX_FRAME:
        raise ProtocolError(f"message of {len(body)} bytes exceeds the {MAX_FRAME}-byte limit")
    return _LEN.pack(len(body)) + body


def decode_length(header: bytes) -> int:
    (length,) = _LEN.unpack(header)
    if length > MAX_FRAME:
        raise ProtocolError(f"frame of {length} bytes exceeds the {MAX_FRAME}-byte limit")
    return int(length)


def decode_body(body: bytes) -> dict[str, Any]:
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(f"invalid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("a message must be a JSON object")
    return obj


# ----------------------------------------------------------------------------- server


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


def _peer_groups(pid: int) -> set[int]:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Groups:"):
                return {int(g) for g in line.split()[1:]}
    except OSError:
        pass
    return set()


def peer_allowed(pid: int, uid: int, gid: int, group_id: int | None) -> bool:
    if uid in (0, os.getuid()):
        return True
    return group_id is not None and (gid == group_id or group_id in _peer_groups(pid))


class ControlServer:
    """Serves ``handler(request) -> answer`` on a Unix socket until cancelled."""

    def __init__(
        self,
        path: Path,
        handler: Handler,
        *,
        socket_group: str = "",
        read_timeout: float = READ_TIMEOUT,
        send_timeout: float = SEND_TIMEOUT,
    ) -> None:
        self.path = path
        self.handler = handler
        self.read_timeout = read_timeout
        self.send_timeout = send_timeout
        self.group_id: int | None = None
        if socket_group:
            import grp

            self.group_id = grp.getgrnam(socket_group).gr_gid

    async def serve(self, *, task_status: TaskStatus[None] | None = None) -> None:
        import anyio

        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # a dead daemon's socket (the pidfile lock says it is dead)
        mode = 0o660 if self.group_id is not None else 0o600
        listener = await anyio.create_unix_listener(self.path, mode=mode)
        if self.group_id is not None:
            os.chown(self.path, -1, self.group_id)
        if task_status is not None:
            task_status.started()
        failed, logged_at = 0, -ACCEPT_LOG_EVERY_S
        try:
            async with listener, anyio.create_task_group() as tg:
                while True:
                    try:
                        stream = await listener.accept()
                    except (OSError, anyio.BrokenResourceError) as exc:
                        # EMFILE, ENFILE, ENOBUFS (anyio wraps them in BrokenResourceError): wait a
                        # little and accept again, never end the daemon; logged at a bounded rate
                        failed += 1
                        now = anyio.current_time()
                        if now - logged_at >= ACCEPT_LOG_EVERY_S:
                            from atroposd.logs import get_logger

                            get_logger("atroposd.control", component="daemon").warning(
                                "control socket cannot accept", error=_accept_error(exc), failures=failed
                            )
                            failed, logged_at = 0, now
                        await anyio.sleep(ACCEPT_RETRY_S)
                        continue
                    tg.start_soon(self._connection, stream)
        finally:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    async def _connection(self, stream: SocketStream) -> None:
        """One client: every error stays in its connection (the client gets ``{"ok": false,
        "error": ...}`` when it can still be told); nothing but cancellation leaves this task,
        which runs in the daemon's main task group."""
        import anyio

        from atroposd.logs import get_logger

        log = get_logger("atroposd.control", component="daemon")
        try:
            async with stream:
                try:
                    await self._serve_one(stream, log)
                except anyio.get_cancelled_exc_class():
                    raise
                except Exception as exc:
                    log.exception("control connection failed")
                    with contextlib.suppress(Exception):
                        await _send(
                            stream,
                            {"ok": False, "error": f"internal error: {type(exc).__name__}: {exc}"},
                            self.send_timeout,
                        )
        except anyio.get_cancelled_exc_class():
            raise
        except Exception as exc:  # closing a connection the peer broke
            log.debug("control connection close failed", error=f"{type(exc).__name__}: {exc}")

    async def _serve_one(self, stream: SocketStream, log: FilteringBoundLogger) -> None:
        import anyio
        from anyio.abc import SocketAttribute
        from anyio.streams.buffered import BufferedByteReceiveStream

        pid, uid, gid = peer_credentials(stream.extra(SocketAttribute.raw_socket))
        if not peer_allowed(pid, uid, gid, self.group_id):
            log.warning("control client refused", peer_pid=pid, peer_uid=uid)
            await _send(stream, {"ok": False, "error": "permission denied", "errno": "EACCES"}, self.send_timeout)
            return
        buffered = BufferedByteReceiveStream(stream)
        try:
            with anyio.fail_after(self.read_timeout):
                length = decode_length(await buffered.receive_exactly(_LEN.size))
                request = decode_body(await buffered.receive_exactly(length))
        except (
            TimeoutError,
            anyio.IncompleteRead,
            anyio.EndOfStream,
            anyio.BrokenResourceError,
            anyio.ClosedResourceError,
            OSError,
        ) as exc:
            log.debug("control client gave up", peer_pid=pid, error=type(exc).__name__)
            return
        except ProtocolError as exc:
            await _send(stream, {"ok": False, "error": str(exc)}, self.send_timeout)
            return
        try:
            answer = await self.handler(request)
        except anyio.get_cancelled_exc_class():
            raise
        except Exception as exc:
            log.exception("control request failed", cmd=_cmd_of(request))
            answer = {"ok": False, "error": f"internal error: {exc}"}
        if not await _send(stream, answer, self.send_timeout):
            log.warning(
                "control client did not take its answer; dropped",
                peer_pid=pid,
                cmd=_cmd_of(request),
                deadline_s=self.send_timeout,
            )


def _accept_error(exc: BaseException) -> str:
    """What made an accept fail: the OS error itself when anyio wrapped it."""
    cause = exc.__cause__ if isinstance(exc.__cause__, OSError) else exc
    return f"{type(cause).__name__}: {cause}"


def _cmd_of(request: dict[str, Any]) -> str:
    """The request's command for a log line: a short string whatever the client sent."""
    return repr(request.get("cmd"))[:64]


def encode_answer(answer: dict[str, Any]) -> bytes:
    """An answer as a frame; one too large for the frame becomes an error that says so (a
    handler cuts what it can to :data:`ANSWER_LIMIT` first: ``status`` does)."""
    try:
        return encode(answer)
    except ProtocolError as exc:
        return encode(
            {
                "ok": False,
                "error": f"the answer does not fit the control frame: {exc}",
                "cmd_ok": bool(answer.get("ok", False)),
            }
        )
    except TypeError as exc:  # a value JSON cannot carry
        return encode({"ok": False, "error": f"the answer cannot be encoded: {exc}"})


async def _send(stream: SocketStream, answer: dict[str, Any], send_timeout: float) -> bool:
    """Send one answer within ``send_timeout``: a client that stops reading cannot pin the task.
    False when it was not delivered."""
    import anyio

    frame = encode_answer(answer)
    try:
        with anyio.fail_after(send_timeout):
            await stream.send(frame)
        return True
    except (TimeoutError, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
        return False


# ----------------------------------------------------------------------------- client


def request(path: Path, message: dict[str, Any], *, timeout: float = 30.0) -> dict[str, Any]:
    """Send one request to the daemon at ``path`` and return its answer.

    Raises NotRunning (nothing listens there), PermissionDenied (the file system or the daemon
    refused us), ProtocolError (a broken answer) — each with a message for the user.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.settimeout(timeout)
    try:
        try:
            sock.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError):
            raise NotRunning(f"no daemon is running (no control socket at {path})") from None
        except PermissionError:
            raise PermissionDenied(f"permission denied on the control socket {path}") from None
        except OSError as exc:
            if exc.errno == errno.ENOTDIR:
                raise NotRunning(f"no daemon is running (no control socket at {path})") from None
            raise ControlError(f"cannot connect to {path}: {exc.strerror or exc}") from None
        try:
            sock.sendall(encode(message))
            answer = decode_body(_recv_exactly(sock, decode_length(_recv_exactly(sock, _LEN.size))))
        except TimeoutError:
            raise ControlError(f"the daemon did not answer within {timeout:g}s") from None
        except (ConnectionResetError, BrokenPipeError) as exc:
            raise ControlError(f"the daemon closed the connection: {exc}") from None
    finally:
        sock.close()
    if not answer.get("ok", False) and answer.get("errno") == "EACCES":
        raise PermissionDenied(f"permission denied by the daemon on {path}")
    return answer


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    chunks: list[bytes] = []
    while n:
        chunk = sock.recv(min(n, 1 << 16))
        if not chunk:
            raise ProtocolError("the daemon closed the connection mid-answer")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)
