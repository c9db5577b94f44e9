"""Config: a list-valued ``[trainer] device`` (one trainer rank per entry) and the keys of SPEC §12.1."""

from __future__ import annotations

import pytest

from atroposd.config import dump_toml, parse_toml
from atroposd.paths import Paths
from tests.support import config_problems


def test_one_device_is_one_rank() -> None:
    cfg = parse_toml('[trainer]\ndevice = "cpu"\n[inference]\ndevice = "cpu"\n')
    assert cfg.trainer.devices() == ["cpu"] and cfg.trainer.ranks == 1
    assert cfg.weight_sync == "shared"  # auto with one rank and the torch engine


def test_a_device_list_is_one_rank_per_entry_and_auto_is_push() -> None:
    cfg = parse_toml('[trainer]\ndevice = ["cpu", "cpu"]\n')
    assert cfg.trainer.ranks == 2 and cfg.trainer.devices() == ["cpu", "cpu"]
    assert cfg.weight_sync == "push"
    t = cfg.trainer
    assert (
        t.sync_bucket_mb,
        t.join_timeout,
        t.collective_timeout,
        t.max_restarts,
        t.restart_window,
        t.activation_checkpointing,
    ) == (512, 300.0, 600.0, 5, 600.0, False)
    assert parse_toml(dump_toml(cfg)).trainer == cfg.trainer


def test_checkpoint_dir_moves_the_checkpoints(tmp_path: object) -> None:
    cfg = parse_toml('[daemon]\nstate_dir = "/srv/state"\n[trainer]\ncheckpoint_dir = "/shared/ckpt"\n')
    assert Paths.of(cfg).checkpoints_dir.as_posix() == "/shared/ckpt"
    assert (
        Paths.of(parse_toml('[daemon]\nstate_dir = "/srv/state"\n')).checkpoints_dir.as_posix()
        == "/srv/state/checkpoints"
    )


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        (
            '[trainer]\ndevice = ["cpu", "cpu"]\nweight_sync = "shared"\n',
            'trainer.weight_sync: "shared" needs one trainer rank',
        ),
        (
            '[trainer]\ndevice = ["cpu", "cpu"]\nmode = "lora"\nweight_sync = "reload"\n',
            'trainer.mode: "lora" is not supported with several trainer ranks',
        ),
        ('[trainer]\ndevice = ["cpu", "cuda:0"]\n', "every trainer rank must be on the CPU or every one on a GPU"),
        ('[trainer]\ndevice = ["cuda:0", "cuda:0"]\n', "trainer.device[1]: 'cuda:0' is already rank 0's device"),
        ('[trainer]\ndevice = ["auto", "cpu"]\n', "trainer.device[0]: must be cpu, cuda:N or a GPU UUID"),
        ('[trainer]\ndevice = ["cpu", "tpu"]\n', "trainer.device[1]"),
        ("[trainer]\ndevice = []\n", "trainer.device"),
        ("[trainer]\nsync_bucket_mb = 0\n", "trainer.sync_bucket_mb"),
        ("[trainer]\njoin_timeout = 0\n", "trainer.join_timeout"),
        ("[trainer]\ncollective_timeout = -1\n", "trainer.collective_timeout"),
    ],
)
def test_invalid_rank_settings_name_the_key(text: str, fragment: str) -> None:
    problems = config_problems(text)
    assert any(fragment in p for p in problems), problems
