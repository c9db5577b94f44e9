"""Child command lines check their flags by the config schema's rules (one set of bounds),
and the top-level parser builds without import cycles."""

from __future__ import annotations

import argparse

import pytest

from atroposd.api import cli as api_cli
from atroposd.clargs import apply_flags
from atroposd.cli import build_parser
from atroposd.config import ApiConfig, InferenceConfig, parse_config
from atroposd.exitcodes import Exit
from atroposd.inference import cli as inference_cli


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def test_apply_flags_uses_the_schema_bounds() -> None:
    inf = InferenceConfig()
    ns = argparse.Namespace(port=0, max_model_len=4, dtype=None, engine="vllm")
    problems = apply_flags(
        inf, "inference", ns, {"port": "port", "max_model_len": "max_model_len", "dtype": "dtype", "engine": "engine"}
    )
    assert problems == ["--port must be ≥ 1, got 0", "--max-model-len must be ≥ 8, got 4"]
    assert inf.engine == "vllm" and inf.dtype == "auto"  # given flags are applied, absent ones are not


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (("--port", "70000"), "--port must be ≤ 65535"),
        (("--max-queued-sequences", "0"), "--max-queued-sequences must be ≥ 1"),
        (("--full-wait", "-1"), "--full-wait must be ≥ 0"),
        (("--max-request-bytes", "10"), "--max-request-bytes must be ≥ 1024"),
    ],
)
def test_api_flags_out_of_bounds(argv: tuple[str, ...], flag: str) -> None:
    _, _, _, problems = api_cli.settings_from(_args("api", *argv))
    assert len(problems) == 1 and problems[0].startswith(flag)


def test_api_flags_in_bounds_are_applied() -> None:
    settings, _, _, problems = api_cli.settings_from(_args("api", "--port", "8123", "--full-wait", "0"))
    assert problems == [] and settings.port == 8123 and settings.full_wait == 0
    assert ApiConfig().port == 8000  # the schema's default is not touched


def test_inference_flags_out_of_bounds_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        inference_cli.config_from(_args("inference", "--max-model-len", "4", "--seed", "-1"))
    assert exc.value.code == Exit.USAGE
    err = capsys.readouterr().err
    assert "--max-model-len must be ≥ 8, got 4" in err and "--seed must be ≥ 0, got -1" in err


def test_non_loopback_api_without_token_warns_loopback_does_not() -> None:
    def warns(host: str) -> bool:
        cfg = parse_config({"api": {"host": host}})
        return any("not loopback" in w for w in cfg.warnings)

    assert not warns("127.0.0.2") and not warns("::1") and not warns("localhost")
    assert warns("0.0.0.0") and warns("10.0.0.5")
