"""[trainer] enabled = false: API + inference + environments for a trainer that runs elsewhere.
The test is that trainer: it speaks the documented protocol (docs/EXTERNAL-TRAINER.md)."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.jobs import daemon_env, job_config, status
from tests.support import atroposd, wait_for


def _http(url: str, body: Any = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


@pytest.mark.slow  # a whole job or a long search: run by .ci/run, not in the default run
def test_external_trainer_pulls_batches(short_tmp: Path) -> None:
    cfg = job_config(short_tmp, trainer={"enabled": False, "batch_size": 16, "micro_batch_size": 16})
    res = atroposd("start", "-c", str(cfg), env=daemon_env(), timeout=240)
    try:
        assert res.returncode == 0, f"start exited {res.returncode}: {res.stderr[-3000:]}"
        st = status(cfg)
        assert st["trainer"] is None
        api = next(c for c in st["components"] if c["name"] == "api")
        assert api["state"] == "ready"
        api_url = f"http://127.0.0.1:{_port(cfg, 'api')}"
        _http(
            f"{api_url}/register",
            {
                "wandb_group": "",
                "wandb_project": "",
                "batch_size": 16,
                "max_token_len": 64,
                "checkpoint_dir": "",
                "save_checkpoint_interval": 0,
                "starting_step": 0,
                "num_steps": 10,
            },
        )

        def batch() -> Any:
            return _http(f"{api_url}/batch")["batch"]

        got = wait_for(batch, timeout=120, interval=0.2, what="a batch for the external trainer")
        assert sum(len(g["tokens"]) for g in got) == 16
        for g in got:
            assert len(g["tokens"]) == len(g["masks"]) == len(g["scores"])
            for toks, masks, lps in zip(g["tokens"], g["masks"], g["inference_logprobs"], strict=True):
                assert len(toks) == len(masks) == len(lps)
                assert masks[0] == -100 and masks[-1] == toks[-1]
    finally:
        assert atroposd("stop", "-c", str(cfg), timeout=120).returncode == 0


def _port(cfg: Path, section: str) -> int:
    import tomllib

    return int(tomllib.loads(cfg.read_text())[section]["port"])
