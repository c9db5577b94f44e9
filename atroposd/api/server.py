"""The trajectory API on aiohttp: run-api's routes and wire format (ATROPOS-PROTOCOL.md §1.1),
bounded, validated, spooled, observable (SPEC §5).

Routes: ``/`` ``/register`` ``/register-env`` ``/disconnect-env`` ``/wandb_info`` ``/info`` ``/batch``
``/latest_example`` ``/scored_data`` ``/scored_data_list`` ``/status`` ``/status-env`` (GET with a
JSON body) ``/reset_data``, plus ``/atroposd/registrations`` and ``/metrics``.

Request bodies may be gzip (decompressed here, bounded by ``max_request_bytes``, so a gzip
bomb never allocates its expanded size). Every body that a route reads counts against one bound
of bytes in flight as it arrives (a chunked body chunk by chunk), and connections are capped
(past ``max_connections`` a new one is answered 503 and closed). Responses of 1000 bytes and
more are gzip'ed when the client accepts it, as run-api does (:mod:`atroposd.api.httpio`).

Beside the routes: the settings (:mod:`atroposd.api.settings`), the metrics
(:mod:`atroposd.api.metrics`), the peer pid lookup (:mod:`atroposd.api.peers`) and the
connection cap (:mod:`atroposd.httpbounds`).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

from aiohttp import web

from atroposd import pids
from atroposd.api import binary
from atroposd.api.bodies import (
    HAS_LIBDEFLATE,
    groups_from_body,
    gunzip,
    gunzip_if_small,
    parse_json,
)
from atroposd.api.httpio import (
    accepts_gzip,
    batch_body,
    encode,
    from_a_web_page,
    is_json,
    json_plain,
    json_reply,
    send,
    token_ok,
)
from atroposd.api.ingest import ParseHelper
from atroposd.api.metrics import ApiMetrics
from atroposd.api.peers import PeerLookup
from atroposd.api.queue import QueueFull, TrajectoryStore
from atroposd.api.schema import (
    EnvRegistration,
    Group,
    InvalidRequest,
    TrainerRegistration,
    dumps,
    env_id_of,
    group_to_json,
    wait_seconds,
)
from atroposd.api.settings import ApiSettings
from atroposd.api.shmbatch import ShmBatches
from atroposd.httpbounds import FD_RESERVE, RETRY_AFTER_S, BodyRefused, CappedSite, Charge, Inflight, read_body
from atroposd.logs import get_logger
from atroposd.net import host_allowed, is_loopback, own_host_names

__all__ = ["FD_RESERVE", "ApiMetrics", "ApiServer", "ApiSettings"]

log = get_logger("api.server")

# Groups normally reach the parse helper process still compressed; what the API inflates itself
# (the other routes' bodies, groups while the helper is busy or down) inflates on the event loop
# only when it is under GUNZIP_THREAD_MIN_COMPRESSED as sent and its trailer says it holds less
# than GUNZIP_THREAD_MIN_BYTES (libdeflate: into a buffer of exactly that size, so a lying
# trailer stops it there). Every larger body, whatever its trailer says, goes to the inflater
# thread: the loop never inflates more than a few KiB as sent (at most GUNZIP_THREAD_MIN_BYTES).
GUNZIP_THREAD_MIN_BYTES = 1 << 20
GUNZIP_THREAD_MIN_COMPRESSED = 4 << 10
INFLIGHT_BODIES = 4  # bytes of bodies in flight (read, inflated, being parsed): this many max_request_bytes
PARSE_THREAD_MIN_BYTES = 1 << 20  # the loop hands bodies this large to the inflater thread to parse
EMPTY_EXAMPLE: dict[str, list[Any]] = {
    "tokens": [],
    "masks": [],
    "scores": [],
    "advantages": [],
    "ref_logprobs": [],
    "generation_params": [],
    "inference_logprobs": [],
    "messages": [],
    "images": [],
}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ApiServer:
    def __init__(self, store: TrajectoryStore, settings: ApiSettings, helper: ParseHelper | None = None) -> None:
        self.store = store
        self.settings = settings
        self.helper = helper
        self.metrics = ApiMetrics(store, helper)
        self.registrations: deque[dict[str, Any]] = deque(maxlen=4096)
        # One thread inflates large gzip bodies (more would only fight over the GIL on return).
        self._inflater = ThreadPoolExecutor(max_workers=1, thread_name_prefix="api-inflate")
        # One thread plans and writes binary batches (safetensors, shared memory).
        self._batcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="api-batch")
        self.inflight = Inflight(INFLIGHT_BODIES * settings.max_request_bytes)
        self.peers = PeerLookup(self.metrics.peer_lookups_skipped)
        self._own_hosts = own_host_names() if is_loopback(settings.host) else None
        self._site: CappedSite | None = None
        self.shm = ShmBatches(
            store,
            ack_timeout=settings.shm_ack_timeout,
            spool_dir=settings.spool_dir,
            metrics=self.metrics,
            executor=self._batcher,
        )

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.settings.max_request_bytes, middlewares=[self._guard])
        app.on_cleanup.append(self._close_inflater)
        app.on_startup.append(self.shm.on_startup)
        app.on_cleanup.append(self.shm.on_cleanup)
        get, post = app.router.add_get, app.router.add_post
        get("/", self.root)
        post("/register", self.register)
        post("/register-env", self.register_env)
        post("/disconnect-env", self.disconnect_env)
        get("/wandb_info", self.wandb_info)
        get("/info", self.info)
        get("/batch", self.batch)
        post("/batch/ack", self.batch_ack)
        get("/latest_example", self.latest_example)
        post("/scored_data", self.scored_data)
        post("/scored_data_list", self.scored_data_list)
        get("/status", self.status)
        get("/status-env", self.status_env)
        post("/status-env", self.status_env)
        get("/reset_data", self.reset_data)
        get("/atroposd/registrations", self.list_registrations)
        get("/metrics", self.metrics_route)
        for resource in app.router.resources():  # every route's latency series from the start
            self.metrics.latency.labels(resource.canonical)
        return app

    async def _close_inflater(self, app: web.Application) -> None:
        self._inflater.shutdown(wait=True, cancel_futures=True)
        self._batcher.shutdown(wait=True, cancel_futures=True)

    def site(self, runner: web.AppRunner) -> web.TCPSite:
        """The listening site of ``runner`` on the configured address, its connections capped."""
        self._site = CappedSite(
            runner,
            self.settings.host,
            self.settings.port,
            cap=self.settings.connection_cap(),
            refused=self.metrics.refused.labels("connections"),
            what="API",
        )
        return self._site

    def site_connections(self) -> int:
        """Connections open on the site (0 before it started)."""
        return self._site.open if self._site is not None else 0

    @property
    def inflight_bytes(self) -> int:
        return self.inflight.bytes

    @inflight_bytes.setter
    def inflight_bytes(self, value: int) -> None:
        self.inflight.bytes = value

    @property
    def max_inflight_bytes(self) -> int:
        return self.inflight.max_bytes

    @max_inflight_bytes.setter
    def max_inflight_bytes(self, value: int) -> None:
        self.inflight.max_bytes = value

    # ------------------------------------------------------------------ middlewares

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """The one middleware: bearer token, refusals as JSON (4xx/503), request latency. One
        layer rather than three: every posted group passes through it."""
        start = time.perf_counter()
        try:
            if self._own_hosts is not None and not host_allowed(request.headers.get("Host"), self._own_hosts):
                # A page in a browser on this host must not reach a loopback API through DNS rebinding.
                self.metrics.rejected.labels("misdirected").inc()
                return json_plain(
                    {
                        "detail": "Host header names another host; this API answers only to "
                        "localhost, loopback addresses and this machine's names"
                    },
                    status=421,
                )
            if from_a_web_page(request):
                # A page's GET (an image, a link) passes the Host check: its Host is ours.
                self.metrics.rejected.labels("cross_site").inc()
                return json_plain({"detail": "requests from a web page of another site are refused"}, status=403)
            token = self.settings.token
            if token and not token_ok(request.headers.get("Authorization", ""), token):
                self.metrics.rejected.labels("unauthorized").inc()
                return json_plain(
                    {"detail": "missing or wrong bearer token"}, status=401, headers={"WWW-Authenticate": "Bearer"}
                )
            if request.method == "POST" and "Content-Type" in request.headers and not is_json(request.content_type):
                self.metrics.rejected.labels("media_type").inc()
                return json_plain(
                    {"detail": f"Content-Type {request.content_type!r} is not JSON: send application/json"}, status=415
                )
            return await handler(request)
        except BodyRefused as exc:
            if exc.status == 503:
                self.metrics.refused.labels(exc.reason).inc()
                headers = {"Retry-After": str(RETRY_AFTER_S)}
            else:
                self.metrics.rejected.labels(exc.reason).inc()
                headers = None
            log.info("request body refused", path=request.path, status=exc.status, error=str(exc))
            return json_plain({"detail": str(exc)}, status=exc.status, headers=headers)
        except InvalidRequest as exc:
            self.metrics.rejected.labels(exc.reason).inc()
            log.info("request rejected", path=request.path, status=exc.status, error=str(exc))
            return json_plain({"detail": str(exc)}, status=exc.status)
        except QueueFull as exc:
            if exc.too_large:
                self.metrics.rejected.labels("too_large").inc()
                return json_plain({"detail": str(exc)}, status=413)
            self.metrics.refused.labels(exc.reason).inc()
            return json_plain({"detail": str(exc)}, status=503, headers={"Retry-After": str(RETRY_AFTER_S)})
        finally:
            route = request.match_info.route.resource
            self.metrics.observe(route.canonical if route is not None else "unmatched", time.perf_counter() - start)

    # ------------------------------------------------------------------ bodies

    async def _read_raw(self, request: web.Request, charge: Charge) -> tuple[bytes | bytearray, bool]:
        """The request body as sent (at most ``max_request_bytes``) and whether it is gzip; its
        bytes are charged as they arrive (:func:`atroposd.httpbounds.read_body`), the gzip body's
        inflated size by its trailer once it is read."""
        limit = self.settings.max_request_bytes
        raw = await read_body(request, limit=limit, charge=charge, timeout=self.settings.body_timeout)
        gz = bool(raw) and "gzip" in request.headers.get("Content-Encoding", "").lower()
        if gz:
            charge.add(min(_inflated_size(raw, gz), limit))
        return raw, gz

    def _on_loop(self, raw: bytes | bytearray) -> bytes | bytearray | None:
        """A gzip body inflated on the event loop only when it is small compressed (under
        GUNZIP_THREAD_MIN_COMPRESSED) and its trailer says it is small inflated (under
        GUNZIP_THREAD_MIN_BYTES); None: the inflater thread's to inflate. Whatever a trailer
        says, a larger body never inflates on the loop."""
        if len(raw) >= GUNZIP_THREAD_MIN_COMPRESSED:
            return None
        limit = min(self.settings.max_request_bytes, GUNZIP_THREAD_MIN_BYTES - 1)
        if _inflated_size(raw, True) > limit:
            return None
        if HAS_LIBDEFLATE:
            return gunzip_if_small(raw, limit)
        return gunzip(raw, limit)

    async def _inflate(self, raw: bytes | bytearray, gz: bool, charge: Charge | None = None) -> bytes | bytearray:
        """``raw`` decompressed when it is gzip (at most ``max_request_bytes``); what it inflated
        to beyond its trailer's word is charged after the fact."""
        if not gz:
            return raw
        limit = self.settings.max_request_bytes
        body = self._on_loop(raw)
        if body is None:
            body = await asyncio.get_running_loop().run_in_executor(self._inflater, gunzip, raw, limit)
        if charge is not None:
            charge.add(len(body) - min(_inflated_size(raw, gz), limit))
        return body

    async def _read_json(self, request: web.Request, *, optional: bool = False) -> object:
        """The JSON of a request body, its bytes charged while it is read and parsed."""
        charge = Charge(self.inflight)
        try:
            raw, gz = await self._read_raw(request, charge)
            return parse_json(await self._inflate(raw, gz, charge), optional=optional)
        finally:
            charge.release()

    async def _read_groups(self, request: web.Request, *, listed: bool) -> list[Group]:
        """The validated groups of a ``/scored_data`` (one) or ``/scored_data_list`` body: from
        the parse helper when it takes the body (:mod:`atroposd.api.ingest`), else parsed here."""
        charge = Charge(self.inflight)
        try:
            raw, gz = await self._read_raw(request, charge)
            size = len(raw) + (min(_inflated_size(raw, gz), self.settings.max_request_bytes) if gz else 0)
            max_token_len = self.store.max_token_len
            if self.helper is not None:
                groups = await self.helper.groups(raw, gz, listed=listed, max_token_len=max_token_len)
                if groups is not None:
                    return groups
            loop = asyncio.get_running_loop()
            if size >= PARSE_THREAD_MIN_BYTES:  # inflate and parse off the event loop
                limit = self.settings.max_request_bytes
                return await loop.run_in_executor(self._inflater, _groups_of, raw, gz, limit, listed, max_token_len)
            body = await self._inflate(raw, gz, charge)
            if len(body) >= PARSE_THREAD_MIN_BYTES:  # a trailer that said less than it held
                return await loop.run_in_executor(self._inflater, _parse_groups, body, listed, max_token_len)
            return groups_from_body(body, listed=listed, max_token_len=max_token_len)
        finally:
            charge.release()

    def _charge(self, nbytes: int) -> None:
        """Count ``nbytes`` more of bodies in flight; 503 at once when they would pass the bound."""
        try:
            self.inflight.charge(nbytes)
        except BodyRefused as exc:
            raise QueueFull(str(exc), reason="inflight") from None

    # ------------------------------------------------------------------ upstream routes

    async def root(self, request: web.Request) -> web.StreamResponse:
        return await json_reply(request, {"message": "AtroposLib API"})

    async def register(self, request: web.Request) -> web.StreamResponse:
        reg = TrainerRegistration.from_json(await self._read_json(request))
        try:
            uid = self.store.register(reg)
        except OSError as exc:
            return self._spool_refusal(exc)
        log.info(
            "trainer registered",
            batch_size=self.store.registration.batch_size if self.store.registration else None,
            requesters=self.store.requesters,
        )
        # A 128-bit int, as upstream's uuid4().int; orjson stops at 64 bits.
        return await send(request, b'{"uuid":%d}' % uid)

    async def register_env(self, request: web.Request) -> web.StreamResponse:
        req = EnvRegistration.parse_request(await self._read_json(request))
        pid = await self.peers.pid(request)
        start = pids.start_ticks(pid) if pid is not None else None  # identity: boot-relative, exact
        try:
            answer = self.store.register_env(req, peer=(pid, start) if pid is not None and start is not None else None)
        except OSError as exc:
            return self._spool_refusal(exc)
        success = answer["status"] == "success"
        self.registrations.append(
            {
                "env_id": answer.get("env_id"),
                "desired_name": req["desired_name"],
                "peer_pid": pid,
                "status": "success" if success else "wait",
                "at": time.time(),
            }
        )
        if success:
            log.info(
                "environment registered",
                env_id=answer["env_id"],
                name=answer["wandb_name"],
                group_size=req["group_size"],
                peer_pid=pid,
            )
        return await json_reply(request, answer)

    async def disconnect_env(self, request: web.Request) -> web.StreamResponse:
        body = await self._read_json(request)
        env_id = env_id_of(body)
        return await json_reply(request, self.store.disconnect_env(env_id))

    async def wandb_info(self, request: web.Request) -> web.StreamResponse:
        reg = self.store.registration
        return await json_reply(
            request, {"group": reg.wandb_group if reg else None, "project": reg.wandb_project if reg else None}
        )

    async def info(self, request: web.Request) -> web.StreamResponse:
        reg = self.store.registration
        return await json_reply(
            request, {"batch_size": reg.batch_size if reg else -1, "max_token_len": reg.max_token_len if reg else -1}
        )

    async def batch(self, request: web.Request) -> web.StreamResponse:
        store = self.store
        if store.registration is None:
            return await json_reply(
                request, {"status": "error", "message": "Trainer not registered. Call /register first.", "batch": []}
            )
        fmt = binary.requested_format(request.headers.get("Accept", ""), request.query.get("format"))
        if fmt == "shm" and not is_loopback(request.remote):
            raise InvalidRequest(
                "shared-memory batches are for trainers on the API's host; use format=safetensors", 400, "shm_remote"
            )
        wait = wait_seconds(request.query.get("wait"))
        deadline = time.monotonic() + wait
        while True:
            epoch = store.epoch
            try:
                batch = store.take_batch()
            except OSError as exc:
                return self._spool_refusal(exc)
            left = deadline - time.monotonic()
            if batch is not None or left <= 0 or store.registration is None:
                break
            # ?wait=S (an atroposd extension): hold the request until a batch can be formed
            await store.wait_changed(left)
        if batch is None:
            return await json_reply(request, {"batch": None})
        if fmt == "shm":
            try:
                offer = await self.shm.offer(batch, epoch, store.served_step)
            except BaseException as exc:
                store.undeliver(batch, epoch)
                if not isinstance(exc, OSError):
                    raise
                log.error("cannot write a batch into shared memory", error=str(exc))
                # Like a full spool: the batch went back to the queue, the trainer retries (or asks
                # for format=safetensors); a 503, never a 500 (SPEC §13).
                return json_plain(
                    {"detail": f"cannot create a shared-memory segment: {exc}", "shm": False},
                    status=503,
                    headers={"Retry-After": "1"},
                )
            return await json_reply(request, {"shm": offer})
        resp = web.StreamResponse()
        try:
            if fmt == "safetensors":
                body, headers = await self._safetensors(request, batch, store.served_step)
            else:
                body, headers = await encode(request, batch_body(batch))
            resp.headers.update(headers)
            resp.content_length = len(body)
            await resp.prepare(request)
            await resp.write(body)
            await resp.write_eof()
        except OSError as exc:
            # The trainer went away mid-response: not delivered, it is the next batch served.
            store.undeliver(batch, epoch)
            self.metrics.batch_write_failures.inc()
            log.warning("batch not delivered (connection lost); it is served next", error=str(exc) or repr(exc))
            return resp
        except BaseException:
            store.undeliver(batch, epoch)
            self.metrics.batch_write_failures.inc()
            raise
        store.delivered(batch, epoch)
        self.metrics.batches_served.inc()
        self.metrics.sequences_served.inc(sum(g.n for g in batch))
        return resp

    async def _safetensors(self, request: web.Request, batch: list[Group], step: int) -> tuple[bytes, dict[str, str]]:
        """A batch's safetensors response, planned and filled on the batch thread."""
        return await asyncio.get_running_loop().run_in_executor(
            self._batcher,
            partial(
                binary.response_body,
                batch,
                step,
                remote=not is_loopback(request.remote),
                accepts_gzip=accepts_gzip(request),
            ),
        )

    async def batch_ack(self, request: web.Request) -> web.StreamResponse:
        """``POST /batch/ack {"batch_id", "release"?}``: a shared-memory batch was received (or,
        with ``release``, cannot be read and is to be served again)."""
        body = await self._read_json(request)
        batch_id = body.get("batch_id") if isinstance(body, dict) else None
        if not isinstance(body, dict) or not isinstance(batch_id, str) or not batch_id:
            raise InvalidRequest("field required: batch_id (a string)")
        return await json_reply(request, self.shm.ack(batch_id, release=bool(body.get("release", False))))

    async def latest_example(self, request: web.Request) -> web.StreamResponse:
        g = self.store.latest
        return await send(request, dumps(group_to_json(g)) if g is not None else dumps(EMPTY_EXAMPLE))

    async def scored_data(self, request: web.Request) -> web.StreamResponse:
        answers = await self._accept(await self._read_groups(request, listed=False))
        if answers is None:
            return self._spool_refusal(None)
        return await json_reply(request, answers[0])

    async def scored_data_list(self, request: web.Request) -> web.StreamResponse:
        groups = await self._read_groups(request, listed=True)
        answers = await self._accept(groups)
        if answers is None:
            return self._spool_refusal(None)
        out: dict[str, Any] = {"status": "received", "groups_processed": len(groups)}
        buffered = [a for a in answers if a["status"] == "buffered"]
        if buffered:
            out["buffered"] = len(buffered)
            out["last_buffer_size"] = buffered[-1]["buffer_size"]
        return await json_reply(request, out)

    async def _accept(self, groups: list[Group]) -> list[dict[str, Any]] | None:
        """Reserve room (waiting up to full_wait), then accept all groups or none; None when the
        spool could not keep them."""
        n = sum(g.n for g in groups)
        await self.store.reserve(n, self.settings.full_wait, sum(g.nbytes for g in groups))
        try:
            answers = self.store.submit(groups)
        except OSError as exc:
            log.error("spool cannot keep a submission; refused", error=str(exc), groups=len(groups))
            return None
        self.metrics.accepted_groups.inc(len(groups))
        self.metrics.accepted_sequences.inc(n)
        return answers

    def _spool_refusal(self, exc: OSError | None) -> web.Response:
        self.metrics.refused.labels("spool").inc()
        detail = "the spool cannot keep this request" + (f": {exc}" if exc else "")
        return json_plain({"detail": detail}, status=503, headers={"Retry-After": str(RETRY_AFTER_S)})

    async def status(self, request: web.Request) -> web.StreamResponse:
        return await json_reply(request, self.store.status())

    async def status_env(self, request: web.Request) -> web.StreamResponse:
        body = await self._read_json(request, optional=True)
        if (body is None or (isinstance(body, dict) and "env_id" not in body)) and "env_id" in request.query:
            body = {"env_id": request.query["env_id"]}  # the form later atroposlib forks send
        env_id = env_id_of(body)
        answer = self.store.status_env(env_id)
        if not isinstance(body, dict) or "wait_s" not in body:
            return await json_reply(request, answer)  # as run-api answers
        # An atroposd extension: {"wait_s": S, "dequeued": N} holds the answer until this
        # environment's groups leave the queue (its "dequeued" count is no longer N), the
        # environments change, or S seconds pass; the answer adds "dequeued".
        wait = wait_seconds(body.get("wait_s"))
        seen = body.get("dequeued")
        deadline = time.monotonic() + wait
        while isinstance(seen, int) and self.store.dequeued_of(env_id) == seen:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            version = self.store.env_version
            await self.store.wait_changed(left)
            if self.store.env_version != version:
                break
        answer = self.store.status_env(env_id)
        return await json_reply(request, {**answer, "dequeued": self.store.dequeued_of(env_id)})

    async def reset_data(self, request: web.Request) -> web.StreamResponse:
        self.store.reset()
        self.registrations.clear()
        log.info("data reset")
        return web.Response(text="Reset successful", content_type="text/plain")

    # ------------------------------------------------------------------ extras

    async def list_registrations(self, request: web.Request) -> web.StreamResponse:
        envs = [
            {"env_id": e.registered_id, "name": e.real_name, "connected": e.connected, "peer_pid": e.peer_pid}
            for e in self.store.envs
        ]
        return await json_reply(request, {"registrations": list(self.registrations), "envs": envs})

    async def metrics_route(self, request: web.Request) -> web.StreamResponse:
        from prometheus_client import CONTENT_TYPE_LATEST

        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


def _groups_of(raw: bytes | bytearray, gz: bool, limit: int, listed: bool, max_token_len: int | None) -> list[Group]:
    return groups_from_body(gunzip(raw, limit) if gz else raw, listed=listed, max_token_len=max_token_len)


def _parse_groups(body: bytes | bytearray, listed: bool, max_token_len: int | None) -> list[Group]:
    return groups_from_body(body, listed=listed, max_token_len=max_token_len)


def _inflated_size(raw: bytes | bytearray, gz: bool) -> int:
    """What a body inflates to by its gzip trailer (ISIZE, modulo 4 GiB): where to inflate it is
    decided by this, not by its compressed size; a lying trailer only moves work to the thread."""
    if not gz:
        return len(raw)
    return int.from_bytes(raw[-4:], "little") if len(raw) >= 18 else len(raw)
