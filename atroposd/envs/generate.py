"""A client of the inference server's Atropos ``POST /generate`` (SPEC §7, ATROPOS-PROTOCOL §1.4),
routing each generation to one of several inference replicas (SPEC §12.2).

An unreachable or restarting server (connection refused, 5xx) is waited for with a visible
retry, as atroposlib's VLLMServer does; a 4xx is a bad request no retry can fix and raises
``GenerateError``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import anyio
import orjson
from structlog.typing import FilteringBoundLogger

from atroposd.envs.retry import CONNECTION_ERRORS, Backoff, Retry, retry_after
from atroposd.logs import get_logger


class GenerateError(RuntimeError):
    """The server refused the request (4xx) or answered in a shape that breaks the protocol."""


@dataclass(frozen=True)
class Completion:
    """One sampled completion: its tokens (a sampled EOS included, as the last one) and the
    inference logprob of each token, aligned one to one."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


@dataclass(frozen=True)
class Generation:
    completions: list[Completion]
    weight_version: int | None
    #: per completion, ``[[token_index, version], ...]`` when one spans a weight swap (SPEC §7)
    weight_versions: list[list[list[int]]] | None = None


# A replica marked down is asked whether it is ready again at most this often.
RECHECK_S = 1.0
RECHECK_TIMEOUT_S = 2.0


@dataclass(eq=False)
class ReplicaState:
    """One inference replica as this client sees it."""

    url: str
    in_flight: int = 0
    served: int = 0
    down: bool = False
    checked_at: float = -math.inf
    checking: bool = False


def _base(url: str) -> str:
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


class InferenceClient:
    """``POST /generate`` to one inference server, or to several replicas (SPEC §12.2): each
    generation goes to the ready replica with the fewest requests in flight; a replica that
    fails (unreachable, 5xx) is skipped — its request goes to another at once — until it
    answers ready again (``GET /info``: loaded and not awaiting weights; checked at most every
    ``RECHECK_S``). With every replica down the client waits with a visible backoff, as with one."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        url: str | Sequence[str],
        *,
        log: FilteringBoundLogger | None = None,
        token: str = "",
    ) -> None:
        self._session = session
        # The inference servers' bearer token (SPEC §12.3), on every request when there is one.
        self._auth = {"Authorization": f"Bearer {token}"} if token else {}
        urls = [url] if isinstance(url, str) else list(url)
        if not urls:
            raise ValueError("InferenceClient needs at least one URL")
        self.replicas = [ReplicaState(_base(u)) for u in urls]
        self._log = log or get_logger("envs.generate")
        self.retries = 0

    def served(self) -> list[int]:
        """Generations each replica answered, in the order of the URLs."""
        return [r.served for r in self.replicas]

    async def generate(
        self,
        prompt_ids: Sequence[int],
        *,
        n: int,
        max_tokens: int,
        temperature: float,
        top_p: float = 1.0,
        seed: int | None = None,
    ) -> Generation:
        """``n`` completions of one prompt, with the logprob of every sampled token."""
        body: dict[str, Any] = {
            "prompt": {"prompt_token_ids": list(prompt_ids)},
            "n": n,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "logprobs": 0,
        }
        if seed is not None:
            body["seed"] = seed
        backoff = Backoff(self._log, "generate")
        while True:
            replica = await self._pick()
            replica.in_flight += 1
            try:
                answer = await self._post(replica.url, body)
                break
            except Retry as retry:
                self.retries += 1
                if len(self.replicas) > 1:
                    self._mark_down(replica, retry.reason)
                    if any(not r.down for r in self.replicas):
                        continue  # another replica takes it at once
                await backoff.wait(retry)
            finally:
                replica.in_flight -= 1
        backoff.done()
        replica.served += 1
        return parse_generation(answer, n)

    async def _pick(self) -> ReplicaState:
        """The ready replica with the fewest requests in flight (then the fewest served); with
        none ready, the least busy of all (its failure is waited for with backoff)."""
        if len(self.replicas) == 1:
            return self.replicas[0]
        now = anyio.current_time()
        due = [r for r in self.replicas if r.down and not r.checking and now - r.checked_at >= RECHECK_S]
        for r in due:
            await self._recheck(r)
        ready = [r for r in self.replicas if not r.down] or self.replicas
        return min(ready, key=lambda r: (r.in_flight, r.served))

    def _mark_down(self, replica: ReplicaState, reason: str) -> None:
        if not replica.down:
            self._log.warning(
                "inference replica unavailable; skipping it until it is ready again", url=replica.url, reason=reason
            )
        replica.down = True
        replica.checked_at = anyio.current_time()

    async def _recheck(self, replica: ReplicaState) -> None:
        """Ask a down replica whether it serves again: ``/info`` ready and not awaiting weights
        (a server without ``/info``: ``/health`` answers 200)."""
        replica.checking = True
        try:
            with anyio.move_on_after(RECHECK_TIMEOUT_S):
                ready = await self._ready(replica.url)
                if ready:
                    replica.down = False
                    self._log.info("inference replica ready again", url=replica.url)
        finally:
            replica.checking = False
            replica.checked_at = anyio.current_time()

    async def _ready(self, url: str) -> bool:
        try:
            async with self._session.get(url + "/info", headers=self._auth) as resp:
                if resp.status == 404:
                    async with self._session.get(url + "/health", headers=self._auth) as health:
                        return health.status == 200
                if resp.status != 200:
                    return False
                info = orjson.loads(await resp.read())
        except (*CONNECTION_ERRORS, orjson.JSONDecodeError):
            return False
        # a replica the trainer's sentinel quarantined (SPEC §15) answers 503 until it is let back
        return (
            isinstance(info, dict)
            and info.get("ready", True) is not False
            and not info.get("awaiting_weights")
            and not info.get("quarantined")
        )

    async def _post(self, url: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            async with self._session.post(
                url + "/generate", data=orjson.dumps(body), headers={"Content-Type": "application/json", **self._auth}
            ) as resp:
                text = await resp.text()
                status, retry_header = resp.status, resp.headers.get("Retry-After")
        except CONNECTION_ERRORS as exc:
            raise Retry(f"inference server unreachable: {type(exc).__name__}: {exc}", connection=True) from exc
        if status >= 500:
            raise Retry(f"/generate answered {status}: {text[:200]}", delay=retry_after(retry_header))
        if status != 200:
            raise GenerateError(f"/generate answered {status}: {text[:500]}")
        try:
            answer = orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            raise GenerateError(f"/generate answered with a body that is not JSON: {text[:200]!r}") from exc
        if not isinstance(answer, dict):
            raise GenerateError(f"/generate answered {type(answer).__name__}, not an object")
        return answer


def parse_generation(answer: dict[str, Any], n: int) -> Generation:
    """Read ``logprobs`` ([completion][token] = [{"<id>": lp}]), ``token_ids`` (when present, they
    must agree with the logprob keys) and ``finish_reasons``; anything malformed is an error."""
    logprobs = answer.get("logprobs")
    reasons = answer.get("finish_reasons")
    if not isinstance(logprobs, list) or len(logprobs) != n:
        raise GenerateError(f"/generate: expected 'logprobs' for {n} completions, got {_shape(logprobs)}")
    if not isinstance(reasons, list) or len(reasons) != n:
        raise GenerateError(f"/generate: expected {n} 'finish_reasons', got {_shape(reasons)}")
    token_lists = answer.get("token_ids")
    completions = []
    for i, per_token in enumerate(logprobs):
        ids, lps = _read_logprobs(per_token, i)
        if token_lists is not None:
            given = token_lists[i] if isinstance(token_lists, list) and i < len(token_lists) else None
            if given != ids:
                raise GenerateError(
                    f"/generate: completion {i}: token_ids {given} disagree with the logprob keys {ids}"
                )
        completions.append(Completion(token_ids=ids, logprobs=lps, finish_reason=str(reasons[i])))
    version = answer.get("weight_version")
    spans = answer.get("weight_versions")
    if spans is not None and (
        not isinstance(spans, list)
        or len(spans) != n
        or not all(
            isinstance(r, list)
            and r
            and all(isinstance(x, list) and len(x) == 2 and all(type(y) is int for y in x) for x in r)
            for r in spans
        )
    ):
        raise GenerateError(f"/generate: expected 'weight_versions' for {n} completions, got {_shape(spans)}")
    return Generation(
        completions=completions,
        weight_version=int(version) if version is not None else None,
        weight_versions=spans,
    )


def _read_logprobs(per_token: object, index: int) -> tuple[list[int], list[float]]:
    if not isinstance(per_token, list):
        raise GenerateError(f"/generate: logprobs[{index}] is {_shape(per_token)}, not a list")
    ids: list[int] = []
    lps: list[float] = []
    for j, item in enumerate(per_token):
        # atroposlib reads item[0]: a one-element list holding {"<token_id>": logprob}.
        entry = item[0] if isinstance(item, list) and item else item
        if not isinstance(entry, dict) or len(entry) != 1:
            raise GenerateError(f'/generate: logprobs[{index}][{j}] must be [{{"<token_id>": logprob}}], got {item!r}')
        ((key, value),) = entry.items()
        try:
            ids.append(int(key))
            lps.append(float(value))
        except (TypeError, ValueError) as exc:
            raise GenerateError(f"/generate: logprobs[{index}][{j}] = {item!r} is not id → logprob") from exc
    return ids, lps


def _shape(value: object) -> str:
    if isinstance(value, list):
        return f"a list of {len(value)}"
    return "nothing" if value is None else type(value).__name__
