"""The replica sentinel (SPEC §15): is every inference replica computing with the trainer's weights?

Every ``canary_every``-th sync, each replica generates greedily from the job's canary prompts
(``POST /canary`` on its weight-control socket: served while quarantined, admitted under exactly
one ``weight_version``), and the trainer scores the same tokens with its own weights (on the
compute thread, between steps, in its compute dtype; nothing else of the trainer is touched). The
mean absolute difference of the two logprobs per generated token is the replica's drift.

A replica over ``drift_limit`` is quarantined (its generation routes answer 503, so the clients
route around it), synced again and checked again: drift that falls after a resync says that the
last sync's weights had not arrived. Still over: it is restarted when a restart is available
(``restart``: the restarted replica awaits the current weights before it serves) and checked once
more; still over after that, the job goes on with the replicas that pass, this one kept in
quarantine, and the log says so (drift that stays while the weights are the trainer's: the
replica computes differently — kernels, dtype, tokenizer or chat template).

Several machines (SPEC §12.3): the head's sentinel checks every node's replicas too
(:class:`RemoteReplica`: the node's replica generates, over the signed cluster messages, and the
head's trainer scores the tokens); a drifting one is quarantined, resynced (a push through its
node's first rank) and restarted by its own node at the head's word.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from atroposd.logs import get_logger
from atroposd.weights.client import WeightControlClient, WeightControlError

if TYPE_CHECKING:
    from atroposd.config import Config
    from atroposd.trainer.ranks import Ranks
    from atroposd.weights.sync import WeightSync

__all__ = [
    "CanaryResult",
    "RemoteReplica",
    "Sentinel",
    "builtin_prompts",
    "canary_items",
    "follow_canary",
    "make_sentinel",
    "score_completion",
    "score_on_ranks",
]

log = get_logger(__name__)

CANARY_MAX_TOKENS = 16  # greedy tokens per canary prompt
CANARY_PROMPT_LEN = 12  # tokens of a built-in canary prompt
CANARY_TIMEOUT_S = 60.0
CANARY_PROMPT_MAX = 48  # tokens of an environment's prompt kept for the canary (its beginning)
# Another node's replica that answers from a version older than the sync's is asked again this
# many times, this long apart (its node's first rank may still be feeding it the sync).
REMOTE_VERSION_TRIES, REMOTE_VERSION_WAIT_S = 25, 0.2

#: runs ``fn(*args)`` on the trainer's compute thread and returns its result
RunOnCompute = Callable[..., Awaitable[Any]]


class RemoteReplica(Protocol):
    """An inference replica of another node, reached through the cluster link (SPEC §12.3)."""

    label: str  # "node N replica I"

    async def canary(self, bodies: Sequence[dict[str, Any]], within: float) -> list[dict[str, Any]]:
        """The replica's answers to the canary requests ``bodies`` (as ``POST /canary`` answers:
        ``logprobs`` and ``weight_version``); :class:`WeightControlError` when it does not answer."""
        ...

    async def care(self, op: str, reason: str, within: float) -> bool:
        """``quarantine``, ``release`` or ``restart`` the replica, by its own node; True when done."""
        ...


Target = Path | RemoteReplica | None


def builtin_prompts(
    count: int, vocab_size: int, *, length: int = CANARY_PROMPT_LEN, first_id: int = 3
) -> list[list[int]]:
    """``count`` fixed token prompts (the same for a given vocabulary): ids spread over
    ``[first_id, vocab_size)``, past the usual pad/bos/eos ids."""
    span = max(1, vocab_size - first_id)
    return [[first_id + (7919 * (p + 1) + 104729 * j * (p + 3)) % span for j in range(length)] for p in range(count)]


def score_completion(model: torch.nn.Module, prompt: Sequence[int], completion: Sequence[int]) -> list[float]:
    """The model's log p of each completion token given everything before it (no grad)."""
    from atroposd.trainer.model import token_logprobs

    tokens = list(prompt) + list(completion)
    device = next(model.parameters()).device
    ids = torch.tensor([tokens[:-1]], device=device)
    labels = torch.tensor([tokens[1:]], device=device)
    mask = torch.zeros_like(labels, dtype=torch.bool)
    mask[0, len(prompt) - 1 :] = True
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logp, _ = token_logprobs(model, ids, mask, labels, torch.ones(1, device=device))
    finally:
        model.train(was_training)
    return [float(x) for x in logp.float().cpu().tolist()]


class CanaryResult:
    """One replica's canary: the drift (None: no token generated) and the version it ran at."""

    def __init__(self, drift: float | None, version: int | None, tokens: int, seconds: float) -> None:
        self.drift = drift
        self.version = version
        self.tokens = tokens
        self.seconds = seconds


class Sentinel:
    """The canary checks of every replica after a sync, and what follows a drift over the limit."""

    def __init__(
        self,
        *,
        every: int,
        limit: float,
        prompts: Sequence[Sequence[int]],
        sockets: Callable[[], Sequence[Path | None]],
        run: RunOnCompute,
        restart: Callable[[int], Awaitable[bool]] | None = None,
        max_tokens: int = CANARY_MAX_TOKENS,
        timeout: float = CANARY_TIMEOUT_S,
        ranks: Callable[[], Ranks | None] | None = None,
        source: str = "built-in",
        wanted: int = 0,
        vocab_size: int = 0,
        max_prompt_len: int = CANARY_PROMPT_MAX,
        remote: Callable[[], Sequence[RemoteReplica]] | None = None,
        restart_timeout: float = 300.0,
    ) -> None:
        self.every = every
        self.limit = limit
        self.prompts = [list(p) for p in prompts]
        # where the prompts come from: "built-in" (until ``wanted`` environment prompts arrived,
        # 0: fixed already) or "environments" (fixed for the rest of the job)
        self.source = source
        self.wanted = wanted if source == "built-in" else 0
        self.vocab_size = vocab_size
        self.max_prompt_len = max(1, max_prompt_len)
        self._seen: dict[tuple[int, ...], None] = {}  # environment prompts so far, in arrival order
        self.sockets = sockets
        self.remote = remote  # the other nodes' replicas (the head of several machines)
        self.restart_timeout = restart_timeout
        self.run = run
        self.restart = restart
        self.ranks = ranks  # the trainer's current ranks (several: every rank scores the canary)
        self.given_up: set[int] = set()  # replicas still over after their restart: not restarted again
        self.max_tokens = max_tokens
        self.timeout = timeout
        self.syncs = 0
        self.drift: list[float | None] = []  # per replica, the last check's
        self.quarantined: dict[int, str] = {}  # replica → why
        self.resyncs = 0
        self.restarts = 0
        self.checks = 0  # canary checks of one replica
        self.check_seconds = 0.0  # their total time (generation + scoring)
        self.last_check_s: float | None = None  # the last round's time, every replica

    # ------------------------------------------------------------------ reporting

    def targets(self) -> list[Target]:
        """Every replica checked: this node's (their weight-control sockets), then every other
        node's (several machines, on the head)."""
        out: list[Target] = list(self.sockets())
        if self.remote is not None:
            out.extend(self.remote())
        return out

    def labels(self) -> list[str]:
        """Each checked replica's name: its index here, "node N replica I" on another node."""
        return [t.label if _is_remote(t) else str(i) for i, t in enumerate(self.targets())]  # type: ignore[union-attr]

    def replica_drift(self) -> list[float | None]:
        """Each replica's last drift (None: not checked yet), like ``replica_generations``; the
        other nodes' replicas after this node's."""
        n = len(self.targets())
        return [self.drift[i] if i < len(self.drift) else None for i in range(n)]

    def status(self) -> dict[str, Any]:
        return {
            "replica_drift": self.replica_drift(),
            "replicas": self.labels(),
            "drift_limit": self.limit,
            "canary_every": self.every,
            "quarantined": {str(k): v for k, v in sorted(self.quarantined.items())},
            "resyncs": self.resyncs,
            "restarts": self.restarts,
            "checks": self.checks,
            "canary_source": self.source,
            "canary_prompts": len(self.prompts),
            "check_s": None if not self.checks else round(self.check_seconds / self.checks, 4),
            "last_round_s": None if self.last_check_s is None else round(self.last_check_s, 4),
        }

    # ------------------------------------------------------------------ the prompts

    def offer(self, groups: Sequence[Any]) -> bool:
        """The groups the trainer received: their prompts (the masked -100 prefix of each group's
        first sequence, its first ``max_prompt_len`` tokens) until ``wanted`` distinct ones have
        arrived; then they are the canary's for the rest of the job. True when that happened now."""
        if not self.wanted:
            return False
        for group in groups:
            prompt = _group_prompt(group, self.vocab_size, self.max_prompt_len)
            if prompt is not None:
                self._seen.setdefault(tuple(prompt), None)
            if len(self._seen) >= self.wanted:
                self.prompts = [list(p) for p in list(self._seen)[: self.wanted]]
                self.source, self.wanted = "environments", 0
                self._seen.clear()
                log.info(
                    "canary prompts chosen from the environments' first prompts",
                    prompts=len(self.prompts),
                    tokens=[len(p) for p in self.prompts],
                )
                return True
        return False

    # ------------------------------------------------------------------ the checks

    def due(self) -> bool:
        """Count one sync; True when this one is checked."""
        self.syncs += 1
        return self.every > 0 and self.syncs % self.every == 0

    async def after_sync(self, sync: WeightSync, model: torch.nn.Module, version: int) -> None:
        """After a sync that reached the replicas: every ``every``-th one, check each replica."""
        if not self.due():
            return
        await self.check_all(sync, model, version)

    async def check_all(self, sync: WeightSync, model: torch.nn.Module, version: int) -> list[float | None]:
        start = time.perf_counter()
        sockets = self.targets()
        while len(self.drift) < len(sockets):
            self.drift.append(None)
        for i, sock in enumerate(sockets):
            if sock is None:
                continue
            result = await self.measure(sock, model, version)
            if result is None:
                continue  # unreachable (restarting): the next round checks it
            self.drift[i] = result.drift
            if result.drift is not None and result.drift > self.limit:
                if i in self.given_up:
                    await self._recheck(i, sync, model, version, result.drift)
                else:
                    await self._heal(i, sync, model, version, result.drift)
            else:
                if result.drift is not None:
                    self.given_up.discard(i)  # it passes: a later drift is healed from the start again
                if i in self.quarantined:
                    await self._release(i, sock, drift=result.drift)
        self.last_check_s = time.perf_counter() - start
        log.info(
            "canary check",
            weight_version=version,
            replica_drift=[_r(d) for d in self.drift],
            seconds=round(self.last_check_s, 4),
            drift_limit=self.limit,
        )
        return list(self.drift)

    async def measure(self, sock: Target, model: torch.nn.Module, version: int) -> CanaryResult | None:
        """Generate greedily from every canary prompt on the replica behind ``sock`` (this node's
        weight-control socket, or another node's replica) and score the same tokens here; None
        when the replica does not answer."""
        start = time.perf_counter()
        assert sock is not None
        client = None if _is_remote(sock) else WeightControlClient(sock, timeout=self.timeout)  # type: ignore[arg-type]
        answers: list[tuple[list[int], list[int], list[float]]] = []
        seen: int | None = None
        try:
            # every prompt at once: the engine batches them as it batches rollouts
            bodies = [canary_body(prompt, self.max_tokens) for prompt in self.prompts]
            if client is None:
                # another node's replica gets the sync through its node's first rank: it may still be
                # applying it when the head's sync returns, so an answer from an older version is
                # asked again for a short while
                for _ in range(REMOTE_VERSION_TRIES):
                    replies = await sock.canary(bodies, self.timeout)  # type: ignore[union-attr]
                    if len(replies) != len(bodies):
                        raise WeightControlError(f"{len(replies)} canary answers for {len(bodies)} prompts")
                    got = [a.get("weight_version") for a in replies]
                    if not any(isinstance(v, int) and v < version for v in got):
                        break
                    await asyncio.sleep(REMOTE_VERSION_WAIT_S)
            else:
                replies = await asyncio.gather(*(client.request("POST", "/canary", b) for b in bodies))
            for prompt, ans in zip(self.prompts, replies, strict=True):
                tokens, lps = _completion(ans)
                if self.vocab_size and not all(0 <= t < self.vocab_size for t in tokens):
                    raise WeightControlError("a canary answer holds token ids outside the vocabulary")
                seen = ans.get("weight_version") if isinstance(ans.get("weight_version"), int) else seen
                if tokens:
                    answers.append((prompt, tokens, lps))
        except WeightControlError as exc:
            log.warning(
                "canary not answered; the replica is checked at the next round", socket=str(sock), error=str(exc)
            )
            return None
        finally:
            if client is not None:
                await client.close()
        if seen is not None and seen != version:
            log.warning("canary answered at another weight_version", expected=version, got=seen, socket=str(sock))
        ranks = self.ranks() if self.ranks is not None else None
        items = [(p, t) for p, t, _ in answers]
        if ranks is not None and ranks.world > 1:
            ours = await self.run(score_on_ranks, ranks, model, items)
        else:
            ours = await self.run(_score_all, model, items)
        diffs = [
            abs(a - b)
            for (_, _, theirs), mine in zip(answers, ours, strict=True)
            for a, b in zip(theirs, mine, strict=True)
        ]
        seconds = time.perf_counter() - start
        self.checks += 1
        self.check_seconds += seconds
        drift = sum(diffs) / len(diffs) if diffs else None
        return CanaryResult(drift, seen, len(diffs), seconds)

    # ------------------------------------------------------------------ over the limit

    async def _quarantine(self, sock: Target, on: bool, reason: str = "") -> None:
        if _is_remote(sock):  # by its own node, at this word
            if not await sock.care("quarantine" if on else "release", reason, self.timeout):  # type: ignore[union-attr]
                log.warning("quarantine not reached", replica=str(sock), on=on)
            return
        assert sock is not None
        client = WeightControlClient(sock, timeout=self.timeout)  # type: ignore[arg-type]
        try:
            await client.request("POST", "/quarantine", {"quarantine": on, "reason": reason})
        except WeightControlError as exc:
            log.warning("quarantine not reached", socket=str(sock), on=on, error=str(exc))
        finally:
            await client.close()

    async def _release(self, i: int, sock: Target, *, drift: float | None) -> None:
        self.quarantined.pop(i, None)
        await self._quarantine(sock, False)
        log.info("replica back in rotation", replica=i, drift=_r(drift), drift_limit=self.limit)

    async def _remeasure(self, i: int, sock: Target, model: torch.nn.Module, version: int) -> float | None:
        """Replica ``i``'s canary again: its drift, recorded (None: no answer or no token)."""
        again = await self.measure(sock, model, version)
        self.drift[i] = None if again is None else again.drift
        return self.drift[i]

    async def _resync(
        self, i: int, sock: Target, sync: WeightSync, model: torch.nn.Module, version: int
    ) -> float | None:
        """Sync replica ``i`` again with the trainer's weights, then :meth:`_remeasure` it. Another
        node's replica: a push that reaches the other nodes only (their first ranks feed theirs)."""
        from atroposd.weights.sync import REMOTE_ONLY

        self.resyncs += 1
        await sync.reattach(model, version, replica=REMOTE_ONLY if _is_remote(sock) else i)
        return await self._remeasure(i, sock, model, version)

    async def _heal(self, i: int, sync: WeightSync, model: torch.nn.Module, version: int, drift: float) -> None:
        sock = self.targets()[i]
        assert sock is not None
        remote = _is_remote(sock)
        reason = f"canary drift {drift:.4g} over drift_limit {self.limit:g} at weight_version {version}"
        self.quarantined[i] = reason
        await self._quarantine(sock, True, reason)
        log.warning(
            "replica drift over the limit: quarantined, syncing it again",
            replica=i,
            **({"where": sock.label} if remote else {}),  # type: ignore[union-attr]
            drift=_r(drift),
            drift_limit=self.limit,
            weight_version=version,
        )
        after = await self._resync(i, sock, sync, model, version)
        if after is not None and after <= self.limit:
            log.warning(
                "replica drift fell after a resync: the weights of the sync had not arrived",
                replica=i,
                drift_before=_r(drift),
                drift_after=_r(after),
                weight_version=version,
                cause="weights not arrived",
            )
            await self._release(i, sock, drift=after)
            return
        if remote or self.restart is not None:
            log.warning(
                "replica still drifts after a resync: restarting it",
                replica=i,
                drift_before=_r(drift),
                drift_after=_r(after),
                weight_version=version,
            )
            self.restarts += 1
            if remote:  # its own node restarts it; the head pushes the current weights to it
                back = await sock.care("restart", reason, self.restart_timeout)  # type: ignore[union-attr]
                if back:
                    await sync.reattach(model, version, replica=_remote_only())
            else:
                assert self.restart is not None
                back = await self.restart(i)
            if back:
                # the restarted replica got the current weights before it served (reattach)
                sock = self.targets()[i] or sock
                after = await self._remeasure(i, sock, model, version)
                if after is not None and after <= self.limit:
                    log.warning(
                        "replica drift fell after a restart",
                        replica=i,
                        drift_before=_r(drift),
                        drift_after=_r(after),
                        weight_version=version,
                        cause="replica restarted",
                    )
                    await self._release(i, sock, drift=after)
                    return
                await self._quarantine(sock, True, reason)  # a new process starts unquarantined
            else:
                log.warning("the replica's restart did not bring it back ready", replica=i)
        self.given_up.add(i)
        if len(self.quarantined) >= len(self.targets()):
            # no replica would be left to generate: the job keeps this one serving, and says so
            log.error(
                "replica still drifts with the trainer's weights, and no other replica passes: it "
                "keeps serving; it computes differently (kernels, dtype, tokenizer or chat template)",
                replica=i,
                drift_before=_r(drift),
                drift_after=_r(after),
                drift_limit=self.limit,
                cause="drift with the same weights",
                restarted=self.restart is not None,
            )
            self.quarantined.pop(i, None)
            await self._quarantine(sock, False)
            return
        log.error(
            "replica still drifts with the trainer's weights: the job goes on without it "
            "(quarantined); it computes differently (kernels, dtype, tokenizer or chat template)",
            replica=i,
            drift_before=_r(drift),
            drift_after=_r(after),
            drift_limit=self.limit,
            cause="drift with the same weights",
            restarted=self.restart is not None,
            serving=[j for j in range(len(self.targets())) if j not in self.quarantined],
        )

    async def _recheck(self, i: int, sync: WeightSync, model: torch.nn.Module, version: int, drift: float) -> None:
        """A replica given up on (still over after its restart) that is over again: synced again and
        measured; back in rotation if it passes, else kept out — never restarted again."""
        sock = self.targets()[i]
        assert sock is not None
        after = await self._resync(i, sock, sync, model, version)
        if after is not None and after <= self.limit:
            self.given_up.discard(i)
            await self._release(i, sock, drift=after)
            return
        if i in self.quarantined or len(self.quarantined) + 1 < len(self.targets()):
            reason = f"canary drift {drift:.4g} over drift_limit {self.limit:g} at weight_version {version}"
            self.quarantined[i] = reason
            await self._quarantine(sock, True, reason)  # again: it may have restarted meanwhile
            log.info("replica still drifts: kept out of rotation", replica=i, drift=_r(drift), drift_after=_r(after))
        else:
            log.info(
                "replica still drifts: it keeps serving, no other replica passes",
                replica=i,
                drift=_r(drift),
                drift_after=_r(after),
            )


def _score_all(model: torch.nn.Module, items: Sequence[tuple[list[int], list[int]]]) -> list[list[float]]:
    """:func:`score_completion` of every (prompt, completion) in one padded batch (right padding:
    a causal model's positions before the padding do not see it)."""
    from atroposd.trainer.model import token_logprobs

    if not items:
        return []
    seqs = [list(p) + list(t) for p, t in items]
    width = max(len(x) for x in seqs) - 1
    device = next(model.parameters()).device
    ids = torch.zeros((len(seqs), width), dtype=torch.long)
    labels = torch.zeros((len(seqs), width), dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.bool)
    for row, ((prompt, _), seq) in enumerate(zip(items, seqs, strict=True)):
        ids[row, : len(seq) - 1] = torch.tensor(seq[:-1])
        labels[row, : len(seq) - 1] = torch.tensor(seq[1:])
        mask[row, len(prompt) - 1 : len(seq) - 1] = True
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logp, _ = token_logprobs(
                model, ids.to(device), mask.to(device), labels.to(device), torch.ones(len(seqs), device=device)
            )
    finally:
        model.train(was_training)
    flat = [float(x) for x in logp.float().cpu().tolist()]  # row by row, the masked positions in order
    out, at = [], 0
    for _, completion in items:
        out.append(flat[at : at + len(completion)])
        at += len(completion)
    return out


def score_on_ranks(
    ranks: Ranks, model: torch.nn.Module, items: Sequence[tuple[list[int], list[int]]]
) -> list[list[float]]:
    """Rank 0 of several: tell every rank to score the canary (``Canary``), send them the
    (prompt, completion) pairs, and score them together (the sharded forward's collectives
    match); rank 0's logprobs are the result. On rank 0's compute thread."""
    from atroposd.trainer.group import Canary

    ranks.command(Canary())
    ranks.broadcast([[list(p), list(t)] for p, t in items])
    return _score_all(model, items)


def follow_canary(ranks: Ranks, model: torch.nn.Module, vocab_size: int) -> None:
    """A follower rank's side of :func:`score_on_ranks`: rank 0's pairs, checked, scored."""
    from atroposd.trainer.group import BadCommand

    value = ranks.broadcast(None)
    items = canary_items(value, vocab_size)
    if items is None:
        raise BadCommand("canary: the pairs must be [[prompt ids], [completion ids]] within the vocabulary")
    _score_all(model, items)


def canary_items(value: object, vocab_size: int) -> list[tuple[list[int], list[int]]] | None:
    """Broadcast canary pairs as (prompt, completion) lists of token ids, or None when malformed."""
    if not isinstance(value, list):
        return None
    out = []
    for pair in value:
        if not isinstance(pair, list) or len(pair) != 2:
            return None
        prompt, completion = pair
        for ids in (prompt, completion):
            if (
                not isinstance(ids, list)
                or not ids
                or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in ids)
            ):
                return None
        out.append((prompt, completion))
    return out


def _group_prompt(group: object, vocab_size: int, limit: int) -> list[int] | None:
    """The prompt of a group's first sequence (its masked -100 prefix), at most ``limit`` tokens
    of it; None when the group has none or is malformed."""
    if not isinstance(group, dict):
        return None
    tokens, masks = group.get("tokens"), group.get("masks")
    if not isinstance(tokens, list) or not isinstance(masks, list) or not tokens or not masks:
        return None
    tok, msk = tokens[0], masks[0]
    if not isinstance(tok, list) or not isinstance(msk, list) or len(tok) != len(msk):
        return None
    n = 0
    while n < len(msk) and msk[n] == -100:
        n += 1
    if n == 0 or n == len(tok):
        return None
    prompt = tok[: min(n, limit)]
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in prompt):
        return None
    return prompt


def canary_body(prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """The ``POST /canary`` request of one canary prompt: greedy, its sampled tokens' logprobs
    (the same from the head's sentinel and from a node answering it over the cluster link)."""
    return {"prompt": {"prompt_token_ids": prompt}, "max_tokens": max_tokens, "n": 1, "temperature": 0.0, "logprobs": 0}


def _completion(ans: dict[str, Any]) -> tuple[list[int], list[float]]:
    """The first completion's token ids and their logprobs from a /generate answer."""
    per_token = (ans.get("logprobs") or [[]])[0]
    tokens: list[int] = []
    lps: list[float] = []
    for entry in per_token:
        ((tid, lp),) = list(entry[0].items())
        tokens.append(int(tid))
        lps.append(float(lp))
    return tokens, lps


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 5)


def _is_remote(target: object) -> bool:
    """Another node's replica (reached through the cluster link), not a socket of this node's."""
    return target is not None and not isinstance(target, Path)


def _remote_only() -> int:
    from atroposd.weights.sync import REMOTE_ONLY

    return REMOTE_ONLY


def make_sentinel(
    cfg: Config,
    weights: WeightSync,
    run: RunOnCompute,
    vocab_size: int,
    *,
    ranks: Callable[[], Ranks | None] | None = None,
    restart: Callable[[int], Awaitable[bool]] | None = None,
    kept: Sequence[Sequence[int]] | None = None,
    remote: Callable[[], Sequence[RemoteReplica]] | None = None,
) -> Sentinel | None:
    """The job's sentinel (``[health] canary_every``; None when 0 or without local replicas): the
    control socket of every replica the weight sync reaches; the canary prompts ``kept`` by a
    checkpoint, else the built-in ones until the environments' first prompts arrive. ``ranks``:
    the trainer's current ranks (several: every rank scores the canary); ``restart``: restarts
    replica i and returns once it serves the current weights again (True) or failed (False);
    ``remote``: the other nodes' replicas (the head of several machines)."""
    h = cfg.health
    inner = getattr(weights, "inner", weights)
    if h.canary_every <= 0 or not (getattr(inner, "replicas", None) or (remote is not None and remote())):
        return None

    def sockets() -> list[Path | None]:
        return [r.socket for r in getattr(inner, "replicas", [])]

    fixed = [list(p) for p in kept or () if p and all(isinstance(t, int) and 0 <= t < vocab_size for t in p)]
    if fixed:
        prompts, source, wanted = fixed[: h.canary_prompts], "environments", 0
    else:
        prompts, source, wanted = builtin_prompts(h.canary_prompts, vocab_size), "built-in", h.canary_prompts
    # an environment prompt and its greedy tokens fit the replica's context
    room = cfg.inference.max_model_len - CANARY_MAX_TOKENS - 1
    longest = min(CANARY_PROMPT_MAX, room) if room > 0 else CANARY_PROMPT_MAX
    sentinel = Sentinel(
        every=h.canary_every,
        limit=h.drift_limit,
        prompts=prompts,
        sockets=sockets,
        run=run,
        restart=restart,
        ranks=ranks,
        source=source,
        wanted=wanted,
        vocab_size=vocab_size,
        max_prompt_len=longest,
        remote=remote,
        restart_timeout=max(60.0, cfg.trainer.stall_timeout / 2)
        if cfg.trainer.stall_timeout > 0
        else cfg.daemon.stop_timeout + cfg.inference.ready_timeout + 60.0,
    )
    log.info(
        "replica sentinel",
        canary_every=h.canary_every,
        drift_limit=h.drift_limit,
        canary_source="the checkpoint's (the environments' first prompts)"
        if fixed
        else "built-in until the environments' first prompts arrive",
        canary_prompts=len(prompts),
        ranks=cfg.trainer.ranks,
        restart=restart is not None,
        other_nodes_replicas=[r.label for r in remote()] if remote is not None else [],
    )
    return sentinel
