"""A whole job with a hostile client beside its environment (SPEC §13): malformed, absurd and
out-of-vocabulary groups, bad registrations, bombs, foreign Hosts and Content-Types, posted
while it trains. The API refuses what it can see is wrong (never a 500), the trainer rejects
and counts what only it can see, and the job trains to its last step and exits 0."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.jobs import daemon_env, job_config, metrics, status
from tests.support import wait_for

pytestmark = pytest.mark.slow

SEQ = [1, 5, 6, 7, 2]  # a short sequence of the tiny vocabulary


def _group(tokens: list[list[int]] | None = None, **over: Any) -> dict[str, Any]:
    tokens = tokens if tokens is not None else [SEQ] * 8
    g: dict[str, Any] = {
        "tokens": tokens,
        "masks": [[-100, -100, *t[2:]] for t in tokens],
        "scores": [1.0, 0.0] * (len(tokens) // 2),
    }
    g.update(over)
    return g


def _post(
    url: str, body: bytes | dict[str, Any], *, headers: dict[str, str] | None = None, method: str = "POST"
) -> int:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    req = urllib.request.Request(url, data=data, headers=hdrs, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        exc.close()
        return int(exc.code)


def _hostile(api: str) -> dict[str, int]:
    """Every kind of bad input once; returns each one's HTTP status."""
    deep = "[" * 5000 + '"x"' + "]" * 5000  # deeper than any encoder accepts
    deep_body = json.dumps(_group(messages="MARK")).replace('"MARK"', deep).encode()
    bomb = gzip.compress(b"[" * (80 << 20), compresslevel=9)
    big_ids = [[1, 5, 10**6, 7, 2]] * 8
    return {
        # the trainer's to reject: the API cannot know the vocabulary or judge advantages (the
        # distillation arrays are ignored here, distill_coef = 0, and must not hurt either)
        "ids_out_of_vocab": _post(f"{api}/scored_data", _group(big_ids)),
        "ids_negative": _post(f"{api}/scored_data", _group([[1, 5, -3, 7, 2]] * 8)),
        "advantage_absurd": _post(f"{api}/scored_data", _group(advantages=[[1e9] * 5] * 8)),
        "distill_out_of_range": _post(
            f"{api}/scored_data", _group(distill_token_ids=[[[10**6]] * 5] * 8, distill_logprobs=[[[-0.1]] * 5] * 8)
        ),
        # the API's to refuse
        "empty_group": _post(f"{api}/scored_data", {"tokens": [], "masks": [], "scores": []}),
        "score_nan": _post(f"{api}/scored_data", b'{"tokens": [[1,2]], "masks": [[1,2]], "scores": [NaN]}'),
        "deep_passthrough": _post(f"{api}/scored_data", deep_body),
        "gzip_bomb": _post(f"{api}/scored_data", bomb, headers={"Content-Encoding": "gzip"}),
        "not_json": _post(f"{api}/scored_data", b"{not json"),
        "wrong_content_type": _post(f"{api}/scored_data", _group(), headers={"Content-Type": "text/plain"}),
        "foreign_host": _post(f"{api}/reset_data", b"", headers={"Host": "evil.example"}, method="GET"),
        "register_absurd": _post(
            f"{api}/register-env",
            {
                "max_token_length": 64,
                "desired_name": "hostile",
                "weight": 1.0,
                "group_size": 8,
                "min_batch_allocation": 1e308,
            },
        ),
        "register_huge_group": _post(
            f"{api}/register-env",
            {"max_token_length": 64, "desired_name": "hostile", "weight": 1.0, "group_size": 10**9},
        ),
        "messages_without_role": _post(f"{api}/scored_data", _group(messages=[[{"content": "hi"}]] * 8)),
    }


def test_a_hostile_client_never_ends_the_job(short_tmp: Path) -> None:
    cfg = job_config(short_tmp, steps=40)
    from atroposd.config import load_config

    api = f"http://127.0.0.1:{load_config(cfg).api.port}"
    log = (short_tmp / "run.out").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "atroposd", "run", "-c", str(cfg)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**daemon_env(), **_base_env()},
    )
    try:
        wait_for(
            lambda: status(cfg)["trainer"]["step"] >= 2, timeout=240, interval=0.5, what="the trainer's first steps"
        )
        answers = _hostile(api)
        assert all(code < 500 for code in answers.values()), answers
        for name in (
            "empty_group",
            "score_nan",
            "deep_passthrough",
            "not_json",
            "messages_without_role",
            "register_absurd",
            "register_huge_group",
        ):
            assert 400 <= answers[name] < 500, (name, answers[name])
        assert answers["gzip_bomb"] == 413 and answers["wrong_content_type"] == 415
        assert answers["foreign_host"] == 421
        for name in ("ids_out_of_vocab", "ids_negative", "advantage_absurd", "distill_out_of_range"):
            assert answers[name] == 200, (name, answers[name])  # accepted: only the trainer can tell

        def counted() -> dict[str, int] | None:
            rejected = status(cfg)["trainer"]["rejected_groups"]
            return rejected if rejected.get("token_out_of_range", 0) >= 2 else None

        rejected = wait_for(counted, timeout=240, interval=0.5, what="the trainer to reject the bad groups")
        assert rejected.get("advantage_invalid", 0) >= 1, rejected
        assert proc.wait(timeout=400) == 0, (short_tmp / "run.out").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            subprocess.run([sys.executable, "-m", "atroposd", "stop", "-c", str(cfg)], timeout=120, check=False)
            proc.wait(timeout=60)
        log.close()
    rows = metrics(short_tmp / "state")
    assert [r["step"] for r in rows] == list(range(1, 41))
    assert rows[-1]["rejected_groups"].get("token_out_of_range", 0) >= 2


def _base_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "ATROPOSD_CONFIG"}
