"""The tested vLLM range (SPEC §1): inside it vLLM starts, outside it the start is refused with an
error naming the range unless ``[inference.vllm] allow_untested = true``; the ``vllm`` extra says
the same range. (The real vLLM against the check: tests/vllm/test_vllm_range.py.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from atroposd.inference.vllm_range import TESTED_RANGE, UntestedVllm, check_vllm_version

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu", "0.32.7"])
def test_a_vllm_inside_the_range_starts_without_a_word(version: str) -> None:
    assert check_vllm_version(version) is None
    assert check_vllm_version(version, allow_untested=True) is None


@pytest.mark.parametrize("version", ["0.33.0", "0.31.9", "1.0.0", "0.33.0rc1+cpu", "not-a-version"])
def test_a_vllm_outside_the_range_is_refused_naming_the_range(version: str) -> None:
    with pytest.raises(UntestedVllm) as err:
        check_vllm_version(version)
    message = str(err.value)
    assert str(TESTED_RANGE) in message and repr(version) in message
    assert "allow_untested" in message


def test_allow_untested_starts_an_outside_vllm_with_a_warning() -> None:
    warning = check_vllm_version("0.40.1", allow_untested=True)
    assert warning is not None and str(TESTED_RANGE) in warning and "0.40.1" in warning


def test_the_vllm_extra_pins_the_tested_range_with_an_upper_bound() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    (spec,) = project["optional-dependencies"]["vllm"]
    req = Requirement(spec)
    assert req.name == "vllm"
    assert req.specifier == TESTED_RANGE
    assert any(s.operator == "<" for s in req.specifier), "the range needs an upper bound"
