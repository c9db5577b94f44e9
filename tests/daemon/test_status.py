"""Status, the sd_notify line and metrics, assembled from a view of the daemon (no daemon process)."""

from __future__ import annotations

import anyio

from atroposd.config import Config, parse_config
from atroposd.daemon.metrics import DaemonCollector
from atroposd.daemon.state import DaemonState
from atroposd.daemon.status import status, status_line
from tests.daemon.views import Trainer, View
from tests.support import free_port


def _external() -> Config:
    return parse_config(
        {
            "api": {"enabled": False, "url": f"http://127.0.0.1:{free_port()}"},
            "inference": {"enabled": False, "url": f"http://127.0.0.1:{free_port()}"},
            "trainer": {"enabled": False},
        },
        source="/etc/atroposd.toml",
    )


def test_status_of_a_job_with_external_components_nobody_answers() -> None:
    view = View(_external(), state=DaemonState.DEGRADED, start_error=None)
    st = anyio.run(status, view)
    assert st["state"] == "degraded" and st["pid"] == 4242 and st["uptime_s"] == 81.235
    assert st["config"] == "/etc/atroposd.toml" and st["instance"] == "abcdef012345"
    assert st["trainer"] is None and st["queue"] is None and st["start_error"] is None
    assert [(c["name"], c["external"], c["state"], c["pid"]) for c in st["components"]] == [
        ("api", True, "unreachable", None),
        ("inference", True, "unreachable", None),
    ]


def test_status_line_and_trainer_gauges() -> None:
    trainer = Trainer({"state": "training", "step": 3, "total_steps": 10, "loss": 0.5, "reward_mean": None})
    view = View(_external(), trainer=trainer)
    assert status_line(view) == "running: 0/0 components ready; trainer training step 3/10"
    names = {m.name for m in DaemonCollector(view).collect()}
    assert {"atroposd_uptime_seconds", "atroposd_trainer_step", "atroposd_trainer_loss"} <= names
    assert "atroposd_trainer_reward_mean" not in names  # no value yet: no gauge
