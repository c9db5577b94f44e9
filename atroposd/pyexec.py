"""How the package starts its own Python programs (the daemon, its children, the API's parse
helper) so that the working directory is never importable.

``python -m`` puts the current directory first on ``sys.path``: a stray ``atroposd.py``,
``torch.py`` or ``json.py`` in the daemon's working directory would shadow the real one in
every child. ``-P`` (Python 3.11) leaves it out and keeps ``PYTHONPATH``; on 3.10 a small
``-c`` prologue removes it before running the module. A leaf (standard library only).
"""

from __future__ import annotations

import sys

_PROLOGUE = (
    "import runpy, sys; del sys.path[0]; sys.argv[0] = {module!r}; "
    "runpy.run_module({module!r}, run_name='__main__', alter_sys=True)"
)


def python_module(module: str, *, executable: str | None = None) -> list[str]:
    """argv that runs ``python -m MODULE`` without the working directory on ``sys.path``;
    append the module's own arguments."""
    python = executable or sys.executable
    if sys.version_info >= (3, 11):
        return [python, "-P", "-m", module]
    return [python, "-c", _PROLOGUE.format(module=module)]  # pragma: no cover - exercised only on 3.10
