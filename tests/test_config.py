"""Config: defaults, the example file, every invalid config reported with its key path."""

from __future__ import annotations

from pathlib import Path

import pytest

from atroposd.config import ConfigError, dump_toml, load_config, parse_toml, render_example
from tests.support import REPO, atroposd

EXAMPLE = REPO / "atroposd.toml.example"


def test_example_file_is_rendered_from_the_schema() -> None:
    assert EXAMPLE.read_text() == render_example(), "regenerate with: atroposd config example > atroposd.toml.example"


def test_example_equals_builtin_defaults() -> None:
    from_file = parse_toml(EXAMPLE.read_text())
    builtin = load_config(None, discover=False)
    assert from_file == builtin
    assert len(builtin.env) == 1 and builtin.env[0].builtin == "arithmetic"


def test_every_key_has_a_comment_and_is_present() -> None:
    text = EXAMPLE.read_text().splitlines()
    keys = [i for i, line in enumerate(text) if line and not line.startswith(("#", "[")) and " = " in line]
    assert len(keys) > 60
    for i in keys:
        assert text[i - 1].startswith("#"), f"no comment above {text[i]!r}"


def test_show_round_trips(tmp_path: Path) -> None:
    cfg = load_config(None, discover=False)
    again = parse_toml(dump_toml(cfg))
    assert again.trainer == cfg.trainer and again.env == cfg.env and again.inference == cfg.inference


def test_discovery_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("ATROPOSD_CONFIG", raising=False)
    (tmp_path / "atroposd.toml").write_text("[trainer]\nsteps = 7\n")
    assert load_config().trainer.steps == 7
    other = tmp_path / "other.toml"
    other.write_text("[trainer]\nsteps = 9\n")
    monkeypatch.setenv("ATROPOSD_CONFIG", str(other))
    assert load_config().trainer.steps == 9
    explicit = tmp_path / "x.toml"
    explicit.write_text("[trainer]\nsteps = 11\n")
    assert load_config(explicit).trainer.steps == 11


def test_a_file_without_env_is_valid_and_warns(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text("[trainer]\nsteps = 5\n")
    r = atroposd("config", "check", "-c", str(f))
    assert r.returncode == 0, r.stderr
    assert "no [[env]]" in r.stderr


ENV = '[[env]]\nname = "a"\nbuiltin = "arithmetic"\n'

INVALID = [
    ("[daemon]\nbogus = 1\n", "daemon.bogus", "unknown key"),
    ("[trainer]\nstepz = 1\n", "trainer.stepz", "did you mean 'steps'"),
    ("[nope]\nx = 1\n", "nope", "unknown section"),
    ('[trainer]\nsteps = "ten"\n', "trainer.steps", "must be an integer"),
    ("[trainer]\nsteps = 0\n", "trainer.steps", "must be ≥ 1"),
    ("[trainer]\nlr = -1.0\n", "trainer.lr", "must be > 0"),
    ('[trainer]\nloss = "ppo"\n', "trainer.loss", "must be one of"),
    ("[trainer]\nbatch_size = 64\nmicro_batch_size = 48\n", "trainer.micro_batch_size", "must divide"),
    ("[trainer]\nbatch_size = 16\nmicro_batch_size = 32\n", "trainer.micro_batch_size", "must be ≤"),
    (
        "[trainer]\nbatch_size = 4\nmicro_batch_size = 4\n" + ENV,
        "env[0].group_size",
        "must be ≤ trainer.batch_size (4)",
    ),
    ('[inference]\nengine = "vllm"\n[trainer]\nweight_sync = "shared"\n', "trainer.weight_sync", "not possible"),
    ('[trainer]\nmode = "lora"\nweight_sync = "push"\n', "trainer.weight_sync", "lora"),
    ("[api]\nenabled = false\n", "api.url", "required when api.enabled = false"),
    ('[api]\nurl = "http://x:1"\n', "api.url", "must be empty"),
    ("[api]\nport = 9001\n", "inference.port", "port 9001 is already used by api.port"),
    (ENV + ENV, "env[1].name", "duplicate name"),
    ('[[env]]\nname = "a"\n', "env[0]", "exactly one of builtin and command"),
    ('[[env]]\nname = "a"\nbuiltin = "arithmetic"\ncommand = ["x"]\n', "env[0]", "exactly one"),
    ('[[env]]\nname = "a"\nbuiltin = "chess"\n', "env[0].builtin", "unknown built-in"),
    ('[[env]]\nbuiltin = "arithmetic"\n', "env[0].name", "required"),
    ('[[env]]\nname = "a"\ncommand = ["x", "{nope}"]\n', "env[0].command", "unknown placeholder {nope}"),
    ('[[env]]\nname = "a"\nbuiltin = "arithmetic"\nrestart = "sometimes"\n', "env[0].restart", "must be one of"),
    ('[[env]]\nname = "a"\nbuiltin = "arithmetic"\nstop_signal = "SIGFOO"\n', "env[0].stop_signal", "unknown signal"),
    (
        '[[env]]\nname = "a"\nbuiltin = "arithmetic"\noptions = {colour = 1}\n',
        "env[0].options.colour",
        "unknown option",
    ),
    ('[daemon]\nruntime_dir = "/' + "x" * 120 + '"\n', "daemon.runtime_dir", "must fit in 107"),
    ("[trainer]\nadam_betas = [0.9]\n", "trainer.adam_betas", "two numbers"),
    ("[trainer]\nresume = 1\n", "trainer.resume", "must be true or false"),
    ('[inference]\ndevice = "tpu"\n', "inference.device", "must be auto, cpu"),
    ('[inference]\nmodel = "builtin:huge"\n', "inference.model", "unknown built-in model"),
    ("[trainer]\nmax_token_len = 9000\n", "trainer.max_token_len", "inference.max_model_len"),
    ("[daemon]\nstop_timeout = nan\n", "daemon.stop_timeout", "finite"),
    ("env = 3\n", "env", "array of tables"),
    ("[trainer]\nclip_eps = 0.2\nclip_eps_high = 0.1\n", "trainer.clip_eps_high", "must be ≥ trainer.clip_eps"),
    (
        '[trainer]\nloss = "awsft"\nrollout_correction = "token-tis"\n',
        "trainer.rollout_correction",
        'no effect with trainer.loss = "awsft"',
    ),
    ("[trainer]\nrollout_correction_threshold = 1.0\n", "trainer.rollout_correction_threshold", "must be > 1"),
    ('[trainer]\nloss_agg = "seq-sum"\n', "trainer.loss_agg", "must be one of"),
    ('[trainer]\nlr_schedule = "step"\n', "trainer.lr_schedule", "must be one of"),
]


@pytest.mark.parametrize(("text", "path", "fragment"), INVALID, ids=[c[1] + ":" + c[2][:20] for c in INVALID])
def test_invalid_config_names_its_key(text: str, path: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_toml(text)
    rendered = [str(p) for p in info.value.problems]
    assert any(p.startswith(path + ":") and fragment in p for p in rendered), rendered


@pytest.mark.parametrize("case", [0, 9, 15, 20], ids=["unknown-key", "group-size", "duplicate", "placeholder"])
def test_config_check_exits_2_naming_the_key(tmp_path: Path, case: int) -> None:
    text, path, fragment = INVALID[case]
    f = tmp_path / "bad.toml"
    f.write_text(text)
    r = atroposd("config", "check", "-c", str(f))
    assert r.returncode == 2
    assert path in r.stderr and fragment in r.stderr, r.stderr


def test_every_problem_is_reported_at_once() -> None:
    text = '[trainer]\nsteps = 0\nlr = 0\nloss = "x"\n[api]\nport = 0\n' + ENV + ENV
    with pytest.raises(ConfigError) as info:
        parse_toml(text)
    paths = {p.path for p in info.value.problems}
    assert {"trainer.steps", "trainer.lr", "trainer.loss", "api.port", "env[1].name"} <= paths


def test_toml_syntax_error_has_line_and_column(tmp_path: Path) -> None:
    f = tmp_path / "bad.toml"
    f.write_text("[trainer]\nsteps = 3\nlr = = 1\n")
    r = atroposd("config", "check", "-c", str(f))
    assert r.returncode == 2
    assert "line 3, column" in r.stderr, r.stderr


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    r = atroposd("config", "check", "-c", str(tmp_path / "none.toml"))
    assert r.returncode == 2 and "not found" in r.stderr


def test_weight_sync_auto_resolution() -> None:
    assert parse_toml("").weight_sync == "shared"
    assert parse_toml('[inference]\nengine = "vllm"\n').weight_sync == "push"
    assert parse_toml('[inference]\nengine = "vllm"\n[trainer]\nmode = "lora"\n').weight_sync == "reload"


def test_an_env_entry_that_is_not_a_table_is_named_and_the_others_keep_their_index() -> None:
    text = 'env = [1, {name = "a", builtin = "arithmetic"}, {name = "a", builtin = "nope"}]\n'
    with pytest.raises(ConfigError) as info:
        parse_toml(text)
    rendered = [str(p) for p in info.value.problems]
    assert any(p.startswith("env[0]:") and "must be a table" in p for p in rendered), rendered
    assert any(p.startswith("env[2].name:") and "also env[1]" in p for p in rendered), rendered
    assert any(p.startswith("env[2].builtin:") for p in rendered), rendered
