"""One environment replica's Docker Engine API socket (SPEC §16), served with aiohttp.

Every request is forwarded to the engine, streamed both ways (``logs -f``, ``wait``, archives,
image pulls), and an HTTP upgrade (attach, exec start) becomes a raw pipe once the engine has
switched protocols.  On the way:

* creates of containers, volumes and networks are checked (:mod:`.policy`) and labelled
  with the replica's :class:`~.labels.Owner`; a container create past ``max_containers`` is
  refused;
* a container, exec, volume or network named in a request must carry the replica's labels,
  otherwise the answer is the engine's own "no such container" (404) and nothing is forwarded;
* lists and prunes are narrowed to the replica's objects (a label filter, checked again on the
  answer); images are shared;
* anything else (swarm, plugins, podman's own ``/libpod`` API, ``/system/df``) is refused (403).

A refusal is a Docker API error ``{"message": ...}`` naming the reason; it is counted.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from atroposd.logs import get_logger
from atroposd.sandbox.engine import Engine, EngineError
from atroposd.sandbox.labels import Owner
from atroposd.sandbox.policy import Policy, Refused

log = get_logger("atroposd.sandbox")

MAX_KNOWN_EXECS = 4096
MAX_JSON_BODY = 1 << 20  # create and exec bodies: a few hundred bytes in practice
HEAD_LIMIT = 64 << 10  # the engine's response head on an upgrade
PIPE_CHUNK = 64 << 10
WRITE_HIGH_WATER = 1 << 20  # bytes queued towards a peer before the other side is paused
UPGRADE_TIMEOUT = 30.0  # for the engine to answer an upgrade's head
_VERSION = re.compile(r"^/v\d+(?:\.\d+)*(?=/)")
_HOP = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "TE",
        "Trailer",
        "Transfer-Encoding",
        "Upgrade",
        "Host",
        "Content-Length",
    )
)
_SHARED = ("/_ping", "/version", "/info", "/auth", "/build")


def docker_error(status: int, message: str) -> web.Response:
    """A Docker API error: ``{"message": ...}`` as ``application/json`` exactly (the docker CLI
    shows the message only for that content type)."""
    body = json.dumps({"message": message}).encode()
    return web.Response(status=status, body=body, headers={"Content-Type": "application/json"})


def _no_such(kind: str, ref: str) -> Refused:
    return Refused(404, f"No such {kind}: {ref}", "not_owned")


#: narrows a decoded JSON answer (a list) to what the replica may see
_Keep = Callable[[object], object]


class _Feed(Protocol):
    """Where the client's bytes go once a connection is upgraded."""

    def feed_data(self, data: bytes) -> tuple[bool, bytes]: ...
    def feed_eof(self) -> None: ...


class Stats(Protocol):
    """What the proxies report to the daemon (counts; read by status and /metrics)."""

    def created(self, owner: Owner, cid: str) -> None: ...
    def removed(self, owner: Owner, cid: str) -> None: ...
    def refused(self, owner: Owner, reason: str) -> None: ...


class ReplicaProxy:
    """The socket of one environment replica and what it may reach."""

    def __init__(
        self,
        owner: Owner,
        path: Path,
        *,
        engine: Engine,
        policy: Policy,
        max_containers: int,
        stats: Stats,
    ) -> None:
        self.owner = owner
        self.path = path
        self.engine = engine
        self.policy = policy
        self.max_containers = max_containers
        self.stats = stats
        self.containers: set[str] = set()  # full ids created through this socket (or checked)
        self.execs: set[str] = set()
        self._create_lock = asyncio.Lock()
        self._runner: web.AppRunner | None = None
        self._sock: socket.socket | None = None
        self._pipes: set[asyncio.Task[Any]] = set()
        self._inode = 0

    # ------------------------------------------------------------------ lifecycle

    def bind(self) -> None:
        """Bind and listen (0600) now, so the socket exists before the environment starts;
        connections wait in the backlog until :meth:`start` serves them."""
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            sock.bind(str(self.path))
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        self._inode = os.stat(self.path).st_ino
        sock.listen(128)
        sock.setblocking(False)
        self._sock = sock

    async def start(self) -> None:
        assert self._sock is not None
        app = web.Application(client_max_size=MAX_JSON_BODY)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        await web.SockSite(self._runner, self._sock, shutdown_timeout=1.0).start()

    async def close(self) -> None:
        for task in list(self._pipes):
            task.cancel()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        elif self._sock is not None:
            self._sock.close()
        self._sock = None
        try:
            if os.stat(self.path).st_ino == self._inode:  # not a newer proxy's socket at the same path
                self.path.unlink()
        except FileNotFoundError:
            pass

    # ------------------------------------------------------------------ routing

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self._route(request)
        except Refused as exc:
            self.stats.refused(self.owner, exc.reason)
            if exc.reason != "not_owned":
                log.warning("sandbox request refused", unit=self.owner.unit, path=request.path, reason=exc.message)
            return docker_error(exc.status, exc.message)
        except EngineError as exc:
            return docker_error(502, f"atroposd: {exc}")

    async def _route(self, request: web.Request) -> web.StreamResponse:
        raw = request.path
        m = _VERSION.match(raw)
        prefix = m.group(0) if m else ""
        rel = raw[len(prefix) :] or "/"
        parts = [p for p in rel.split("/") if p]
        head = parts[0] if parts else ""
        method = request.method

        async def fwd(
            path: str = rel, *, query: Sequence[tuple[str, str]] | None = None, keep: _Keep | None = None
        ) -> web.StreamResponse:
            return await self._forward(request, prefix + path, query=query, keep=keep)

        if rel in _SHARED or head in ("images", "distribution"):
            if rel == "/build":
                self._check_build(request)
            return await fwd()
        if head == "containers":
            if rel == "/containers/create" and method == "POST":
                return await self._create_container(request, prefix)
            if rel == "/containers/json":
                return await fwd(query=self._narrowed(request), keep=lambda body: self._keep_list(body))
            if rel == "/containers/prune":
                return await fwd(query=self._narrowed(request))
            if len(parts) >= 2:
                cid = await self._container(parts[1])
                action = parts[2:]
                path = "/" + "/".join(["containers", cid, *action])
                if action == ["exec"] and method == "POST":
                    return await self._create_exec(request, prefix + path)
                if self._is_upgrade(request):
                    return await self._upgrade(request, prefix + path)
                resp = await fwd(path)
                if not action and method == "DELETE" and resp.status in (200, 204):
                    self.containers.discard(cid)
                    self.stats.removed(self.owner, cid)
                return resp
        if head == "exec" and len(parts) >= 2:
            eid = await self._exec(parts[1])
            path = "/" + "/".join(["exec", eid, *parts[2:]])
            if self._is_upgrade(request):
                return await self._upgrade(request, prefix + path)
            return await fwd(path)
        if head == "volumes":
            return await self._volumes(request, prefix, parts)
        if head == "networks":
            return await self._networks(request, prefix, parts)
        if rel == "/commit":
            ref = request.query.get("container", "")
            cid = await self._container(ref)
            query = [(k, cid if k == "container" else v) for k, v in request.query.items()]
            return await fwd(query=query)
        if rel == "/events":
            return await fwd(query=self._narrowed(request))
        raise Refused(403, f"atroposd: {rel} is not served through an environment's socket", "not_served")

    # ------------------------------------------------------------------ ownership

    async def _container(self, ref: str) -> str:
        """The full id of this replica's container ``ref`` (an id, a prefix or a name), or 404."""
        if ref in self.containers:
            return ref
        info = await self.engine.inspect("containers", ref)
        labels = ((info or {}).get("Config") or {}).get("Labels")
        cid = (info or {}).get("Id")
        if info is None or not isinstance(cid, str) or not self.owner.owns(labels):
            raise _no_such("container", ref)
        self.containers.add(cid)
        return cid

    async def _exec(self, ref: str) -> str:
        if ref in self.execs:
            return ref
        info = await self.engine.inspect("exec", ref)
        container = (info or {}).get("ContainerID")
        eid = (info or {}).get("ID") or (info or {}).get("Id")
        if info is None or not isinstance(container, str) or not isinstance(eid, str):
            raise _no_such("exec instance", ref)
        try:
            await self._container(container)
        except Refused:
            raise _no_such("exec instance", ref) from None
        self._remember_exec(eid)
        return eid

    def _remember_exec(self, eid: str) -> None:
        if len(self.execs) >= MAX_KNOWN_EXECS:  # one exec a group for days: forget, ask the engine again
            self.execs.clear()
        self.execs.add(eid)

    def _owned_sync(self, ref: str) -> bool:
        return ref in self.containers

    def _keep_list(self, body: object) -> list[dict[str, Any]]:
        if not isinstance(body, list):
            return []
        kept = [c for c in body if isinstance(c, dict) and self.owner.owns(c.get("Labels"))]
        self.containers.update(str(c["Id"]) for c in kept if isinstance(c.get("Id"), str))
        return kept

    def _narrowed(self, request: web.Request) -> list[tuple[str, str]]:
        """The request's query with this replica's label filters added to ``filters``."""
        query = [(k, v) for k, v in request.query.items() if k != "filters"]
        filters: dict[str, Any] = {}
        given = request.query.get("filters")
        if given:
            try:
                filters = json.loads(given)
            except ValueError:
                raise Refused(400, "atroposd: filters is not JSON", "bad_body") from None
            if not isinstance(filters, dict):
                raise Refused(400, "atroposd: filters must be a JSON object", "bad_body")
        label = filters.get("label", [])
        if isinstance(label, dict):  # the older map form {"k=v": true}
            label = [k for k, v in label.items() if v]
        if not isinstance(label, list) or not all(isinstance(x, str) for x in label):
            raise Refused(400, "atroposd: filters.label must be a list of strings", "bad_body")
        filters["label"] = [x for x in label if not x.startswith("atroposd.")] + self.owner.filters()
        query.append(("filters", json.dumps(filters)))
        return query

    def _check_build(self, request: web.Request) -> None:
        mode = request.query.get("networkmode", "")
        if (mode == "host" or mode.startswith("container:")) and not self.policy.allow_privileged:
            raise Refused(403, f"atroposd: a build with networkmode={mode} (refused by [sandbox])", "host_namespace")

    # ------------------------------------------------------------------ creates

    async def _json_body(self, request: web.Request, what: str) -> object:
        raw = await request.read()  # past MAX_JSON_BODY: aiohttp answers 413
        if not raw:
            return {}
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise Refused(400, f"atroposd: the {what} body is not JSON", "bad_body") from None

    async def _create_container(self, request: web.Request, prefix: str) -> web.StreamResponse:
        body = await self._json_body(request, "container create")
        for key in ("HostConfig",):
            host = body.get(key) if isinstance(body, dict) else None
            for field in ("NetworkMode", "PidMode", "IpcMode"):
                mode = host.get(field) if isinstance(host, dict) else None
                if isinstance(mode, str) and mode.startswith("container:"):
                    await self._container(mode.split(":", 1)[1])  # 404 unless it is this replica's
            refs = (host or {}).get("VolumesFrom") if isinstance(host, dict) else None
            for ref in refs if isinstance(refs, list) else []:
                if isinstance(ref, str):
                    await self._container(ref.split(":", 1)[0])
        checked = self.policy.check_container(body, self.owner, self._owned_sync)
        async with self._create_lock:
            # Every container of the replica was created through here, so the ids it knows cover
            # them all (some may be gone since: --rm, max_age); the engine is asked only near the limit.
            if len(self.containers) >= self.max_containers:
                live = await self.engine.containers(self.owner.filters())
                self.containers = {str(c["Id"]) for c in live if isinstance(c.get("Id"), str)}
            if len(self.containers) >= self.max_containers:
                raise Refused(
                    409,
                    f"atroposd: this environment replica has {len(self.containers)} containers, its limit "
                    f"([sandbox] max_containers = {self.max_containers}); remove one first",
                    "max_containers",
                )
            resp, answer = await self._call_json(request, prefix + "/containers/create", checked)
            if resp.status == 201 and isinstance(answer, dict) and isinstance(answer.get("Id"), str):
                self.containers.add(answer["Id"])
                self.stats.created(self.owner, answer["Id"])
            return resp

    async def _create_exec(self, request: web.Request, path: str) -> web.StreamResponse:
        body = await self._json_body(request, "exec create")
        if not isinstance(body, dict):
            raise Refused(400, "atroposd: the exec create body must be a JSON object", "bad_body")
        priv = body.get("Privileged")
        if priv is not None and not isinstance(priv, bool):
            raise Refused(400, "atroposd: Privileged must be a boolean", "bad_body")
        if priv and not self.policy.allow_privileged:
            raise Refused(403, "atroposd: a privileged exec (refused by [sandbox])", "privileged")
        resp, answer = await self._call_json(request, path, body)
        if isinstance(answer, dict) and isinstance(answer.get("Id"), str):
            self._remember_exec(answer["Id"])
        return resp

    async def _volumes(self, request: web.Request, prefix: str, parts: list[str]) -> web.StreamResponse:
        method = request.method
        if parts == ["volumes", "create"] and method == "POST":
            body = self.policy.check_volume(await self._json_body(request, "volume create"), self.owner)
            resp, _ = await self._call_json(request, prefix + "/volumes/create", body)
            return resp
        if parts == ["volumes"]:

            def keep(body: object) -> object:
                if isinstance(body, dict):
                    vols = body.get("Volumes") or []
                    body["Volumes"] = [v for v in vols if isinstance(v, dict) and self.owner.owns(v.get("Labels"))]
                return body

            return await self._forward(request, prefix + "/volumes", query=self._narrowed(request), keep=keep)
        if parts == ["volumes", "prune"]:
            return await self._forward(request, prefix + "/volumes/prune", query=self._narrowed(request))
        if len(parts) == 2:
            info = await self.engine.inspect("volumes", parts[1])
            if info is None or not self.owner.owns(info.get("Labels")):
                raise _no_such("volume", parts[1])
            return await self._forward(request, prefix + "/volumes/" + parts[1])
        raise Refused(404, f"atroposd: {request.path} is not a volume route", "not_served")

    async def _networks(self, request: web.Request, prefix: str, parts: list[str]) -> web.StreamResponse:
        method = request.method
        if parts == ["networks", "create"] and method == "POST":
            body = self.policy.check_network(await self._json_body(request, "network create"), self.owner)
            driver = body.get("Driver") or "bridge"
            if driver != "bridge" and not self.policy.allow_privileged:
                raise Refused(403, f"atroposd: a network with driver {driver!r} (refused by [sandbox])", "network")
            resp, _ = await self._call_json(request, prefix + "/networks/create", body)
            return resp
        if parts == ["networks"]:
            keep = self._keep_owned
            return await self._forward(request, prefix + "/networks", query=self._narrowed(request), keep=keep)
        if parts == ["networks", "prune"]:
            return await self._forward(request, prefix + "/networks/prune", query=self._narrowed(request))
        if len(parts) in (2, 3):
            info = await self.engine.inspect("networks", parts[1])
            if info is None or not self.owner.owns(info.get("Labels")):
                raise _no_such("network", parts[1])
            nid = str(info.get("Id") or parts[1])
            if len(parts) == 3:
                if parts[2] not in ("connect", "disconnect") or method != "POST":
                    raise Refused(404, f"atroposd: {request.path} is not a network route", "not_served")
                connect = await self._json_body(request, "network connect")
                ref = connect.get("Container") if isinstance(connect, dict) else None
                if not isinstance(connect, dict) or not isinstance(ref, str):
                    raise Refused(400, "atroposd: Container must be a string", "bad_body")
                connect["Container"] = await self._container(ref)
                resp, _ = await self._call_json(request, f"{prefix}/networks/{nid}/{parts[2]}", connect)
                return resp
            return await self._forward(request, f"{prefix}/networks/{nid}")
        raise Refused(404, f"atroposd: {request.path} is not a network route", "not_served")

    def _keep_owned(self, body: object) -> list[dict[str, Any]]:
        return (
            [n for n in body if isinstance(n, dict) and self.owner.owns(n.get("Labels"))]
            if isinstance(body, list)
            else []
        )

    # ------------------------------------------------------------------ forwarding

    @staticmethod
    def _headers(request: web.Request) -> CIMultiDict[str]:
        return CIMultiDict((k, v) for k, v in request.headers.items() if k.lower() not in _HOP)

    async def _call_json(self, request: web.Request, path: str, body: object) -> tuple[web.Response, object]:
        """Send a checked JSON body; the answer as a response and decoded."""
        headers = self._headers(request)
        headers["Content-Type"] = "application/json"
        try:
            async with self.engine.session.request(
                request.method,
                f"http://engine{path}",
                params=request.query,
                data=json.dumps(body).encode(),
                headers=headers,
            ) as resp:
                raw = await resp.read()
                out = web.Response(status=resp.status, body=raw, headers=_answer_headers(resp.headers))
        except (aiohttp.ClientError, OSError) as exc:
            raise EngineError(f"the container engine at {self.engine.socket} cannot be reached: {exc}") from exc
        try:
            return out, json.loads(raw) if raw else None
        except ValueError:
            return out, None

    async def _forward(
        self,
        request: web.Request,
        path: str,
        *,
        query: Sequence[tuple[str, str]] | None = None,
        keep: _Keep | None = None,
    ) -> web.StreamResponse:
        """Forward as it is, the body and the answer streamed; ``keep`` narrows a JSON answer."""
        headers = self._headers(request)
        data: AsyncIterator[bytes] | None = None
        if request.body_exists:
            if request.content_length is not None:
                headers["Content-Length"] = str(request.content_length)
            data = _stream(request.content)
        try:
            async with self.engine.session.request(
                request.method,
                f"http://engine{path}",
                params=query if query is not None else request.query,
                data=data,
                headers=headers,
            ) as resp:
                if keep is not None and resp.status == 200:
                    raw = await resp.read()
                    try:
                        body = keep(json.loads(raw))
                    except ValueError:
                        body = keep(None)
                    return web.Response(body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
                length = resp.headers.get("Content-Length")
                if length is not None and length.isdigit() and int(length) <= MAX_JSON_BODY:
                    # a sized answer (inspect, ping, create): whole, in one write
                    body_bytes = await resp.read()
                    return web.Response(
                        status=resp.status, reason=resp.reason, body=body_bytes, headers=_answer_headers(resp.headers)
                    )
                out = web.StreamResponse(status=resp.status, reason=resp.reason, headers=_answer_headers(resp.headers))
                if length is not None and length.isdigit():
                    out.content_length = int(length)
                await out.prepare(request)
                async for chunk in resp.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out
        except (aiohttp.ClientError, OSError) as exc:
            raise EngineError(f"the container engine at {self.engine.socket} failed the request: {exc}") from exc

    @staticmethod
    def _is_upgrade(request: web.Request) -> bool:
        return bool(request.headers.get("Upgrade")) and "upgrade" in request.headers.get("Connection", "").lower()

    async def _upgrade(self, request: web.Request, path: str) -> web.StreamResponse:
        """Attach / exec start with ``Upgrade: tcp``: once the engine switches protocols, the two
        connections are piped to each other raw until either side closes."""
        body = await request.read()
        qs = request.query_string
        lines = [f"{request.method} {path}{'?' + qs if qs else ''} HTTP/1.1", "Host: docker"]
        lines += [f"{k}: {v}" for k, v in self._headers(request).items()]
        lines += ["Connection: Upgrade", f"Upgrade: {request.headers.get('Upgrade', 'tcp')}"]
        lines += [f"Content-Length: {len(body)}"]
        try:
            reader, writer = await asyncio.open_unix_connection(self.engine.socket, limit=HEAD_LIMIT)
        except OSError as exc:
            raise EngineError(f"the container engine at {self.engine.socket} cannot be reached: {exc}") from exc
        try:
            writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), UPGRADE_TIMEOUT)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError) as exc:
            writer.close()
            raise EngineError(f"the container engine did not answer the upgrade: {exc!r}") from exc
        status, reason, answer = _parse_head(head)
        if status != 101:
            try:
                rest = await _read_rest(reader, answer)
            finally:
                writer.close()
            return web.Response(status=status, reason=reason, body=rest, headers=_plain_headers(answer))
        out = web.StreamResponse(status=101, reason=reason or "UPGRADED")
        for k, v in answer.items():
            if k.lower() not in _HOP and k.lower() != "content-length":
                out.headers[k] = v
        out.headers["Connection"] = "Upgrade"
        out.headers["Upgrade"] = answer.get("Upgrade", "tcp")
        await out.prepare(request)
        await self._pipe(request, reader, writer)
        return out

    async def _pipe(self, request: web.Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        transport = request.transport
        protocol = request.protocol
        if transport is None or protocol is None:
            writer.close()
            return
        client: asyncio.Transport = transport
        pipes = self._pipes

        class Forwarder:
            """The client's bytes after the upgrade, written to the engine (aiohttp's payload
            parser seam, as its WebSocket reader uses)."""

            def feed_data(self, data: bytes) -> tuple[bool, bytes]:
                if not writer.is_closing():
                    writer.write(data)
                    if writer.transport.get_write_buffer_size() > WRITE_HIGH_WATER:
                        client.pause_reading()
                        task = asyncio.ensure_future(_resume_after(writer, client))
                        pipes.add(task)
                        task.add_done_callback(pipes.discard)
                return False, b""

            def feed_eof(self) -> None:
                if not writer.is_closing() and writer.can_write_eof():
                    try:
                        writer.write_eof()
                    except OSError:
                        pass

        forwarder = Forwarder()
        protocol.set_parser(forwarder)  # type: ignore[arg-type]  # what aiohttp read past the head
        client.set_protocol(_Upgraded(protocol, forwarder))
        try:
            while True:
                chunk = await reader.read(PIPE_CHUNK)
                if not chunk or transport.is_closing():
                    break
                transport.write(chunk)
                # the client reads slower than the engine writes: wait for its buffer to drain
                while transport.get_write_buffer_size() > WRITE_HIGH_WATER and not transport.is_closing():  # noqa: ASYNC110
                    await asyncio.sleep(0.005)
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            protocol.force_close()


class _Upgraded(asyncio.Protocol):
    """The client's connection once upgraded: its bytes go to the engine; a half-close (stdin's
    end, ``docker run -i``) is passed on while the answer still flows back (aiohttp's own protocol
    would close the connection); the rest is aiohttp's, which ends the handler on a lost
    connection."""

    def __init__(self, inner: asyncio.BaseProtocol, forwarder: _Feed) -> None:
        self.inner = inner
        self.forwarder = forwarder

    def data_received(self, data: bytes) -> None:
        self.forwarder.feed_data(data)

    def eof_received(self) -> bool:
        self.forwarder.feed_eof()
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


async def _resume_after(writer: asyncio.StreamWriter, transport: asyncio.Transport) -> None:
    try:
        await writer.drain()
    except OSError:
        pass
    finally:
        if not transport.is_closing():
            transport.resume_reading()


async def _stream(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    async for chunk in content.iter_any():
        yield chunk


def _answer_headers(headers: Mapping[str, str]) -> CIMultiDict[str]:
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in _HOP)


def _plain_headers(headers: dict[str, str]) -> CIMultiDict[str]:
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in _HOP)


def _parse_head(head: bytes) -> tuple[int, str, dict[str, str]]:
    text = head.decode("latin-1").split("\r\n")
    first = text[0].split(" ", 2)
    try:
        status = int(first[1])
    except (IndexError, ValueError):
        raise EngineError(f"the container engine's answer is not HTTP: {text[0][:80]!r}") from None
    headers: dict[str, str] = {}
    for line in text[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip()] = v.strip()
    return status, first[2] if len(first) > 2 else "", headers


async def _read_rest(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    """The body of a non-upgraded answer: by length, chunks, or until the engine closes."""
    lower = {k.lower(): v for k, v in headers.items()}
    if lower.get("content-length", "").isdigit():
        return await reader.readexactly(int(lower["content-length"]))
    if "chunked" in lower.get("transfer-encoding", "").lower():
        out = b""
        while True:
            size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                await reader.readline()
                return out
            out += await reader.readexactly(size)
            await reader.readline()
    return await reader.read(MAX_JSON_BODY)
