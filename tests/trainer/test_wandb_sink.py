"""W&B logging in offline mode: the run's files hold the steps, a resume continues the same run,
and a W&B failure is a warning, never an exception. Also: environments get the run's group."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from atroposd.config import Config, parse_config, to_dict
from atroposd.trainer.wandb_sink import WandbSink, flatten, run_file, wandb_group

BLOCK = 32768


def _records(path: Path) -> Iterator[bytes]:
    """The records of a ``.wandb`` file (a LevelDB-style log after a 7-byte header)."""
    data = path.read_bytes()
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        room = BLOCK - pos % BLOCK
        if room < 7:
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            pos += room
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            buf = chunk
        elif kind == 3:
            buf += chunk
        elif kind == 4:
            yield buf + chunk
            buf = b""


def history(run_file_path: Path) -> list[dict[str, Any]]:
    """The rows logged to one offline run file."""
    from wandb.proto import wandb_internal_pb2

    rows = []
    for raw in _records(run_file_path):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(raw)
        if rec.WhichOneof("record_type") == "history":
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
    return rows


def offline_runs(state_dir: Path) -> list[Path]:
    """Offline run files, oldest first."""
    return sorted((state_dir / "wandb").glob("offline-run-*/run-*.wandb"), key=lambda p: p.parent.name)


def _cfg(state_dir: Path, **wandb: Any) -> Config:
    return parse_config(
        {"daemon": {"state_dir": str(state_dir)}, "wandb": {"project": "atroposd-test", "mode": "offline", **wandb}}
    )


def test_flatten_nests_objects_and_drops_nulls() -> None:
    assert flatten({"step": 3, "staleness": None, "rejected_groups": {"too_long": 2}}) == {
        "step": 3,
        "rejected_groups/too_long": 2,
    }
    assert flatten({"replica_generations": [4, None, 6]}) == {"replica_generations/0": 4, "replica_generations/2": 6}


def test_offline_run_then_resume_continues_the_same_run(tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    cfg = _cfg(tmp_path / "state", tags=["t1"], name="first")
    first = WandbSink.start(cfg, to_dict(cfg))
    for step in (1, 2, 3):
        first.log({"step": step, "loss": 1.0 / step, "rejected_groups": {"too_long": step}})
    first.close()
    assert first.failed is None
    # resumed from the checkpoint of step 2: rows 3.. again, kept (the x-axis is atroposd's step)
    second = WandbSink.start(cfg, to_dict(cfg))
    for step in (3, 4, 5):
        second.log({"step": step, "loss": 1.0 / step})
    second.close()
    assert second.failed is None and second.run_id == first.run_id
    assert json.loads(run_file(tmp_path / "state").read_text())["id"] == first.run_id
    runs = offline_runs(tmp_path / "state")
    assert len(runs) == 2 and all(p.name == f"run-{first.run_id}.wandb" for p in runs)
    assert [r["step"] for r in history(runs[0])] == [1, 2, 3]
    assert [r["step"] for r in history(runs[1])] == [3, 4, 5]
    assert history(runs[0])[1]["rejected_groups/too_long"] == 2


def test_a_wandb_failure_is_a_warning(tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    cfg = _cfg(blocker / "state")  # nothing can be created under a file
    sink = WandbSink.start(cfg, to_dict(cfg))
    sink.log({"step": 1, "loss": 0.5})
    sink.close(timeout=30)
    assert sink.failed is not None
    sink.log({"step": 2})  # after a failure: ignored, never raised


def test_environments_get_the_run_group(tmp_path: Path) -> None:
    from atroposd.daemon.specs import SpecInputs, env_specs
    from atroposd.paths import Paths

    def env_of(cfg: Config) -> dict[str, str]:
        ins = SpecInputs(
            cfg=cfg,
            paths=Paths.of(cfg),
            nonce="0123456789ab",
            model="m",
            tokenizer="t",
            base_env={},
            python="/usr/bin/python3",
        )
        (spec,) = env_specs(ins, cfg.env[0])
        return {**spec.env, "argv": " ".join(spec.argv)}

    envs = [{"name": "e", "command": ["run", "--group", "{wandb_group}"]}]
    on = parse_config(
        {"daemon": {"state_dir": str(tmp_path)}, "env": envs, "wandb": {"project": "p", "mode": "offline"}}
    )
    group = wandb_group(on)
    assert group.startswith("atroposd-") and group == wandb_group(on)  # kept in state_dir
    env = env_of(on)
    assert env["WANDB_RUN_GROUP"] == group == env["ATROPOSD_WANDB_GROUP"]
    assert env["WANDB_MODE"] == "offline" and env["argv"] == f"run --group {group}"
    named = parse_config({"daemon": {"state_dir": str(tmp_path)}, "env": envs, "wandb": {"group": "g"}})
    assert env_of(named)["WANDB_RUN_GROUP"] == "g"
    off = parse_config({"daemon": {"state_dir": str(tmp_path / "other")}, "env": envs})
    env = env_of(off)
    assert "WANDB_RUN_GROUP" not in env and env["argv"] == "run --group "
    assert not (tmp_path / "other").exists()


def test_online_without_credentials_never_prompts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    for name in [k for k in os.environ if k.startswith("WANDB_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("NETRC", str(tmp_path / "home" / ".netrc"))
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens: no network either way
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "home" / "wandb"))
    cfg = _cfg(tmp_path / "state", mode="online")
    sink = WandbSink.start(cfg, to_dict(cfg))
    sink.log({"step": 1})
    sink.close(timeout=30)
    assert sink.failed is not None and "credentials" in sink.failed


def test_wandb_is_never_imported_without_a_project() -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from atroposd.config import parse_config\n"
        "from atroposd.daemon.specs import placeholder_values\n"
        "from atroposd.trainer import service, wandb_sink\n"
        "assert wandb_sink.wandb_group(parse_config({})) == ''\n"
        "assert 'wandb' not in sys.modules, 'wandb imported'\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert res.returncode == 0, res.stderr
