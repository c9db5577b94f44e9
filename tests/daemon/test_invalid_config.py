"""Invalid configs: exit 2, the offending key named, nothing started."""

from __future__ import annotations

from pathlib import Path

import pytest

from atroposd.cli import main

BASE = """\
[daemon]
runtime_dir = "{d}/run"
state_dir = "{d}/state"
"""

CASES = [
    ("[daemon]\nstop_timeout = 0\n", "daemon.stop_timeout"),
    ('[daemon]\nlog_level = "loud"\n', "daemon.log_level"),
    ("[daemon]\nbogus = 1\n", "daemon.bogus"),
    ("[bogus]\nx = 1\n", "bogus"),
    ("[api]\nport = 70000\n", "api.port"),
    ("[api]\nenabled = false\n", "api.url"),
    ('[inference]\nengine = "tensorrt"\n', "inference.engine"),
    ("[inference]\nport = 8000\n", "inference.port"),
    ("[trainer]\nbatch_size = 8\nmicro_batch_size = 3\n", "trainer.micro_batch_size"),
    ('[trainer]\nlr = "fast"\n', "trainer.lr"),
    ('[trainer]\nbatch_size = 4\n[[env]]\nname = "a"\nbuiltin = "arithmetic"\ngroup_size = 8\n', "env[0].group_size"),
    ('[[env]]\nname = "a"\nbuiltin = "arithmetic"\ncommand = ["x"]\n', "env[0]"),
    ('[[env]]\nname = "a"\ncommand = ["x"]\nrestart = "sometimes"\n', "env[0].restart"),
    ('[[env]]\nname = "a"\ncommand = ["x"]\nstop_signal = "SIGFOO"\n', "env[0].stop_signal"),
    ('[[env]]\nname = "a"\ncommand = ["x"]\n[[env]]\nname = "a"\ncommand = ["y"]\n', "env[1].name"),
    ('[[env]]\nname = "a"\ncommand = ["x", "{nope}"]\n', "env[0].command"),
    ('[[env]]\nname = "a"\ncommand = ["x"]\nreplicas = 0\n', "env[0].replicas"),
    ('[[env]]\ncommand = ["x"]\n', "env[0].name"),
    ("[daemon]\nstop_timeout = 1.0\nstop_timeout = 2.0\n", "line 5"),
]


@pytest.mark.parametrize(("body", "key"), CASES, ids=[k for _, k in CASES])
def test_invalid_config_exits_2_naming_the_key(
    short_tmp: Path, body: str, key: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The CLI's own code path, in-process (an interpreter start per case would dominate)."""
    cfg = short_tmp / "atroposd.toml"
    if body.startswith("[daemon]"):  # merge into the one [daemon] table
        text = BASE.format(d=short_tmp) + body[len("[daemon]\n") :]
    else:
        text = BASE.format(d=short_tmp) + body
    cfg.write_text(text)
    with pytest.raises(SystemExit) as exc:
        main(["start", "-c", str(cfg)])
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    assert key in err, err
    assert not (short_tmp / "run").exists()  # nothing started, nothing created


def test_invalid_config_through_a_real_command_line(short_tmp: Path) -> None:
    from tests.support import atroposd

    cfg = short_tmp / "atroposd.toml"
    cfg.write_text(BASE.format(d=short_tmp) + "stop_timeout = -1\n")
    for cmd in ("start", "run"):
        r = atroposd(cmd, "-c", str(cfg))
        assert r.returncode == 2 and "daemon.stop_timeout" in r.stderr, r.stderr
    assert not (short_tmp / "run").exists()
