"""``broadcast`` (SPEC §7): the weights reach every replica over a torch.distributed group the
trainer forms with it (gloo on the CPU, NCCL on GPUs; :mod:`atroposd.weights.broadcast`),
bucket by bucket, instead of through a staging buffer; any trainer rank count."""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from pathlib import Path
from typing import Any

import anyio
import torch

from atroposd.logs import get_logger
from atroposd.weights.client import WeightControlError
from atroposd.weights.replicas import (
    Cadence,
    OnReplicas,
    Replica,
    Replicas,
    SyncReport,
    sockets_of,
    unpaused,
)
from atroposd.weights.source import (
    DEFAULT_BUCKET_BYTES,
    ModelSource,
    SourceCache,
    SourceFor,
    check_gathered,
    plan_buckets,
)

__all__ = ["BroadcastSync"]

log = get_logger("atroposd.weights.sync")


class BroadcastSync(OnReplicas):
    """``broadcast``: every replica gets the weights over a torch.distributed group of its own
    (gloo on the CPU, NCCL on GPUs), bucket by bucket (SPEC §7; ``atroposd.weights.broadcast``).

    A sync (``attach``, ``after_step`` every ``sync_every`` steps, ``reattach``): pause every
    target → form the group of each target that has none (fresh store prefix, bounded by
    ``form_timeout``; a group that does not form fails that replica's sync — logged, counted in
    ``form_failures`` — and it resumes with what it had) → each replica checks the whole plan
    (``receive``) → for each bucket: ``await source.gather(names)`` → pack it into one flat
    buffer → broadcast it on every live group, in parallel → next bucket → ``finish`` → resume
    every replica with the new version. The trainer's extra memory: the gathered bucket and its
    packed copy (two buckets), never a second model.

    Every bucket is gathered even when no replica is left (with several ranks each gather is a
    collective). A replica that dies or fails mid-broadcast is dropped from the sync, its group
    closed; it stays paused and not current (its server refuses to resume a mix) and gets every
    bucket again from the next sync or ``reattach``. A failure of the trainer itself (a rank lost
    during a gather) closes every group in flight and is raised; ``attach`` (a (re)formed trainer
    group) forms every replica's group afresh, ``reattach`` the restarted replica's.
    """

    mode = "broadcast"

    def __init__(
        self,
        *,
        nonce: str,
        control_socket: Path | None = None,
        control_sockets: Sequence[Path] | None = None,
        sync_every: int = 1,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        source_for: SourceFor = ModelSource,
        backend: str = "gloo",
        device: torch.device | None = None,
        form_timeout: float = 60.0,
        digest: bool = False,
        store_dir: Path | None = None,
    ) -> None:
        from atroposd.weights.broadcast import BroadcastHub

        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.replicas = Replicas(sockets_of(control_socket, control_sockets))
        # the rendezvous: a FileStore in a private directory under store_dir (the runtime directory)
        self.hub = BroadcastHub(secret=nonce, backend=backend, device=device, directory=store_dir)
        self.cadence = Cadence(sync_every)
        self.bucket_bytes = bucket_bytes
        self.source = SourceCache(source_for)
        self.form_timeout = form_timeout
        self.digest = digest  # ask the replicas for each tensor's sha256 (tests, benchmarks)
        self.groups: dict[int, Any] = {}
        self.version = 0
        self.form_failures = 0
        self.send_failures = 0
        self.formations = 0
        #: per replica: formations, form_failures, send_failures, last_transfer_s, last_bytes
        self.per_replica: dict[int, dict[str, float]] = {}
        #: the last sync: buckets, bytes, gather_s, pack_s, send_s, pause_s, seconds
        self.last_sync: SyncReport = {}
        #: the last sync's answer of each replica (``finish``), by replica index
        self.last_results: dict[int, dict[str, Any]] = {}

    def _count(self, replica: int, key: str, add: float = 1.0, *, set_to: float | None = None) -> None:
        row = self.per_replica.setdefault(
            replica,
            {"formations": 0, "form_failures": 0, "send_failures": 0, "last_transfer_s": float("nan"), "last_bytes": 0},
        )
        row[key] = set_to if set_to is not None else row[key] + add

    def replica_status(self, replica: int) -> dict[str, Any]:
        """What ``status --json`` shows of ``replica``'s weight sync."""
        row = self.per_replica.get(replica, {})
        group = self.groups.get(replica)
        transfer = row.get("last_transfer_s", float("nan"))
        return {
            "mode": self.mode,
            "backend": self.hub.backend,
            "group": "formed" if group is not None else "none",
            "formation": group.formation if group is not None else None,
            "formations": int(row.get("formations", 0)),
            "form_failures": int(row.get("form_failures", 0)),
            "send_failures": int(row.get("send_failures", 0)),
            "last_transfer_s": None if transfer != transfer else round(transfer, 6),
        }

    def drop(self, replica: int) -> None:
        """Close ``replica``'s group (it is formed again at its next sync)."""
        group = self.groups.pop(replica, None)
        if group is not None:
            group.close()

    async def attach(self, model: torch.nn.Module, version: int) -> None:
        for i in list(self.groups):  # a (re)formed trainer group: every broadcast group afresh
            self.drop(i)
        await self.publish(model, version, self.replicas)

    async def reattach(self, model: torch.nn.Module, version: int, replica: int | None = None) -> None:
        for r in self.replicas.targets(replica):  # a restarted replica: its old group and weights are gone
            self.drop(r.index)
            r.version = None
        await self.publish(model, version, self.replicas.targets(replica))

    def paused(self, new_version: int | None = None) -> AbstractAsyncContextManager[None]:
        return unpaused(new_version)

    async def after_step(self, model: torch.nn.Module, version: int) -> SyncReport | None:
        """Every ``sync_every`` steps: every bucket to every replica; the sync's report."""
        if not self.cadence.due():
            return None
        if await self.publish(model, version, self.replicas):
            self.cadence.done()
        return self.last_sync

    async def _form(self, r: Replica, version: int) -> bool:
        """``r``'s group, formed now unless it has one; False (logged, counted) when it does not
        form within ``form_timeout`` or the replica refuses to join."""
        if r.index in self.groups:
            return True
        prefix = self.hub.next_prefix(r.index)
        request = await anyio.to_thread.run_sync(
            lambda: self.hub.join_request(prefix, deadline_s=self.form_timeout, timeout_s=self.deadline)
        )
        formed: dict[str, Any] = {}
        joined: dict[str, Any] = {}
        gave_up: list[bool] = []  # the formation's thread stops waiting once this is not empty

        async def form() -> None:
            try:
                formed["group"] = await anyio.to_thread.run_sync(
                    lambda: self.hub.form(
                        prefix, deadline_s=self.form_timeout, timeout_s=self.deadline, cancelled=lambda: bool(gave_up)
                    )
                )
            except Exception as exc:
                formed["error"] = exc
                tg.cancel_scope.cancel()  # the join request is abandoned with it

        async def join() -> None:
            try:
                joined["answer"] = await self.replicas.call("broadcast", request, replica=r)
            except WeightControlError as exc:
                joined["error"] = exc
                gave_up.append(True)  # it will not join: the formation is given up

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(form)
                tg.start_soon(join)
        finally:
            gave_up.append(True)
        group = formed.get("group")
        if group is not None and "error" not in joined:
            self.groups[r.index] = group
            self.formations += 1
            self._count(r.index, "formations")
            log.info("broadcast group formed", replica=r.index, formation=prefix, backend=self.hub.backend)
            return True
        if group is not None:
            group.close()
        self.form_failures += 1
        self._count(r.index, "form_failures")
        error = joined.get("error") or formed.get("error") or "cancelled"
        log.error(
            "broadcast group did not form; this replica's sync failed, training goes on",
            replica=r.index,
            weight_version=version,
            deadline_s=self.form_timeout,
            failures=self.form_failures,
            error=str(error),
        )
        r.current = False
        return False

    async def publish(self, model: torch.nn.Module, version: int, targets: Sequence[Replica]) -> bool:
        """Every bucket to ``targets``; True when every target took them all and resumed."""
        from atroposd.weights.broadcast import layout, pack, plan_body

        start = time.perf_counter()
        source = self.source(model)
        specs = source.specs()
        plan = plan_buckets(specs, self.bucket_bytes)
        if not plan:
            raise ValueError("the model has no tensors to broadcast")
        layouts = [layout([(n, specs[n]) for n in names]) for names in plan]
        gather_s = pack_s = send_s = 0.0
        moved = 0
        self.last_results = {}
        failed: list[Replica] = []
        async with AsyncExitStack() as stack:
            for r in targets:
                await stack.enter_async_context(self.replicas.connected(r))
            reached = await self.replicas.each(targets, lambda r: self.replicas.pause(r, version))
            paused = [r for r, ok in zip(targets, reached, strict=True) if ok]
            pause_s = time.perf_counter() - start
            formed = await self.replicas.each(paused, lambda r: self._form(r, version))
            for r, ok in zip(paused, formed, strict=True):
                if not ok:
                    await self._keep(r)
            live = [r for r, ok in zip(paused, formed, strict=True) if ok]
            body = {
                "op": "receive",
                "weight_version": version,
                "buckets": plan_body(specs, plan),
                "digest": self.digest,
            }
            form_s = time.perf_counter() - start - pause_s
            transfer_start = time.perf_counter()
            started = await self.replicas.each(live, lambda r: self._start_receive(r, version, body, failed))
            live = [r for r, ok in zip(live, started, strict=True) if ok]
            for r in live:
                r.current = False  # from its first bucket to its last it holds a mix
            buf: torch.Tensor | None = None
            try:
                for names, lay in zip(plan, layouts, strict=True):
                    t0 = time.perf_counter()
                    tensors = await source.gather(names)
                    gather_s += time.perf_counter() - t0
                    check_gathered(specs, names, tensors)
                    if live:
                        t0 = time.perf_counter()
                        buf = await anyio.to_thread.run_sync(pack, lay, tensors, buf)
                        pack_s += time.perf_counter() - t0
                        t0 = time.perf_counter()
                        sent = await self._send_all(live, buf[: lay.size], version, failed)
                        send_s += time.perf_counter() - t0
                        live = [r for r, ok in zip(live, sent, strict=True) if ok]
                        moved += lay.size
                    del tensors  # a gathered bucket is dropped before the next one is gathered
            except BaseException:
                # The trainer failed mid-stream (a rank lost in a gather): every group in flight
                # holds a half-sent sync; closing them frees the replicas' receivers at once.
                for r in live:
                    self.drop(r.index)
                    r.current = False
                raise
            finally:
                buf = None
            finished = await self.replicas.each(live, lambda r: self._finish(r, version, failed))
            live = [r for r, ok in zip(live, finished, strict=True) if ok]
            transfer_s = time.perf_counter() - transfer_start
            for r in live:
                self._count(r.index, "last_transfer_s", set_to=transfer_s)
                self._count(r.index, "last_bytes", set_to=moved)
            resumed = await self.replicas.each(live, lambda r: self.replicas.resume(r, version)) if live else []
        self.version = version
        # sync_pause_s / sync_transfer_s: metrics.jsonl's split of the sync (the replicas' pause
        # before the first byte; the stream from the plan's check to the last replica's finish)
        self.last_sync = {
            "buckets": len(plan),
            "bytes": moved,
            "gather_s": gather_s,
            "pack_s": pack_s,
            "send_s": send_s,
            "pause_s": pause_s,
            "form_s": form_s,
            "transfer_s": transfer_s,
            "sync_pause_s": pause_s,
            "sync_transfer_s": transfer_s,
            "seconds": time.perf_counter() - start,
            "staging_bytes": max(lay.size for lay in layouts),
        }
        return len(resumed) == len(targets) and all(resumed)

    async def _start_receive(self, r: Replica, version: int, body: dict[str, Any], failed: list[Replica]) -> bool:
        try:
            return await self.replicas.reached(
                r, version, "broadcast", {**body, "formation": self.groups[r.index].formation}
            )
        except WeightControlError as exc:
            log.error(
                "inference replica refused a broadcast; it keeps what it had",
                replica=r.index,
                weight_version=version,
                error=str(exc),
            )
            self.drop(r.index)
            failed.append(r)
            with anyio.CancelScope(shield=True):
                await self._keep(r)
            return False

    async def _keep(self, r: Replica) -> None:
        """``r``'s sync failed before any byte moved: it serves what it had, or (it never got
        the trainer's weights: a fresh or restarted server) stays paused until a sync reaches it."""
        if r.version is not None:
            await self.replicas.resume(r, r.version)
        r.current = False

    async def _send_all(
        self, live: Sequence[Replica], chunk: torch.Tensor, version: int, failed: list[Replica]
    ) -> list[bool]:
        return await self.replicas.each(live, lambda r: self._send(r, chunk, version, failed))

    async def _send(self, r: Replica, buf: torch.Tensor, version: int, failed: list[Replica]) -> bool:
        group = self.groups.get(r.index)
        if group is None:
            return False
        try:
            await anyio.to_thread.run_sync(group.broadcast, buf)
            return True
        except Exception as exc:
            self.send_failures += 1
            self._count(r.index, "send_failures")
            log.warning(
                "broadcast to an inference replica failed; it is skipped and gets the weights when it is back",
                replica=r.index,
                weight_version=version,
                error=f"{type(exc).__name__}: {exc}",
            )
            self.drop(r.index)
            r.current = False
            failed.append(r)
            return False

    async def _finish(self, r: Replica, version: int, failed: list[Replica]) -> bool:
        group = self.groups.get(r.index)
        if group is None:
            return False
        try:
            answer = await self.replicas.call(
                "broadcast", {"op": "finish", "formation": group.formation, "weight_version": version}, replica=r
            )
        except WeightControlError as exc:
            log.error(
                "inference replica did not complete a broadcast; it stays paused until it gets every bucket again",
                replica=r.index,
                weight_version=version,
                error=str(exc),
            )
            self.drop(r.index)
            r.current = False
            failed.append(r)
            return False
        self.last_results[r.index] = answer
        return True

    def close(self) -> None:
        for i in list(self.groups):
            self.drop(i)
        self.hub.close()
        self.source.forget()
