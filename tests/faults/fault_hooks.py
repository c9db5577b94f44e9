"""The faults the tests inject (``tests/faults``): each patches the package's own functions when
the module that holds them is imported, in the processes whose environment asks for it.

``FAULTS`` maps a fault's name to the module it patches, the patch and a check of its setting.
A new fault: write ``_check_NAME`` and ``_patch_NAME(module, setting)`` and add a row. The
package itself knows nothing of these: a production run never imports this file.
"""

from __future__ import annotations

import asyncio
import importlib.abc
import importlib.machinery
import os
import sys
import threading
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["FAULTS", "check", "install"]


def _log(message: str, **fields: Any) -> None:
    """A warning in the process's own log, where the test reads what happened."""
    from atroposd.logs import get_logger

    get_logger("faults").warning(message, **fields)


# --------------------------------------------------------------------------- the faults


def _check_stall_step(s: Any) -> None:
    if not (isinstance(s, dict) and isinstance(s.get("step"), int) and isinstance(s.get("marker"), str)):
        raise ValueError(f"stall_step wants {{'step': int, 'marker': path}}, got {s!r}")


def _patch_stall_step(module: types.ModuleType, s: dict[str, Any]) -> None:
    """The trainer loop's compute thread blocks for good when it prepares step ``step`` — once:
    not when the file ``marker`` exists (it is created first), so a resumed job goes past it."""
    cls = module.TrainingLoop
    original = cls._prepare

    def _prepare(self: Any, *args: Any, **kwargs: Any) -> Any:
        step = self.progress.step + 1
        marker = Path(s["marker"])
        if step == s["step"] and not marker.exists():
            marker.touch()
            _log("fault: the compute thread blocks for good", step=step)
            threading.Event().wait()
        return original(self, *args, **kwargs)

    cls._prepare = _prepare


def _check_lr_burst(s: Any) -> None:
    ok = isinstance(s, dict) and isinstance(s.get("factor"), (int, float)) and isinstance(s.get("steps"), list)
    if not ok or not all(isinstance(n, int) for n in s["steps"]):
        raise ValueError(f"lr_burst wants {{'steps': [int, ...], 'factor': number}}, got {s!r}")


def _patch_lr_burst(module: types.ModuleType, s: dict[str, Any]) -> None:
    """The trainer loop's optimizer step of each of ``steps`` runs with the learning rate times
    ``factor`` (rank 0's optimizer): a collapse made on purpose."""
    cls = module.TrainingLoop
    original = cls._apply

    def _apply(self: Any) -> None:
        step = self.progress.step + 1
        if step not in s["steps"]:
            original(self)
            return
        groups = self.learner.optimizer.param_groups
        saved = [g["lr"] for g in groups]
        _log("fault: the learning rate is multiplied for this step", step=step, factor=s["factor"])
        for g in groups:
            g["lr"] *= s["factor"]
        try:
            original(self)
        finally:
            for g, lr in zip(groups, saved, strict=True):
                g["lr"] = lr

    cls._apply = _apply


def _check_rank_hang(s: Any) -> None:
    if s != "join":
        raise ValueError(f"rank_hang wants 'join', got {s!r}")


def _patch_rank_hang(module: types.ModuleType, s: str) -> None:
    """A trainer rank (a follower: rank 1 and up) hangs for good before it joins its group."""

    def connect_store(*args: Any, **kwargs: Any) -> Any:
        _log("fault: this rank never joins")
        threading.Event().wait()

    module.connect_store = connect_store


def _check_corrupt_weights(s: Any) -> None:
    ok = isinstance(s, dict) and all(
        isinstance(k, str) and isinstance(v, str) and v.rstrip("+").isdigit() for k, v in s.items()
    )
    if not ok:
        raise ValueError(f"corrupt_weights wants {{replica name: 'N' or 'N+'}}, got {s!r}")


def _patch_corrupt_weights(module: types.ModuleType, s: dict[str, str]) -> None:
    """The replica named NAME (``ATROPOSD_NAME``: ``inference-0``...) adds noise to its weights
    right after its N-th weight update request (``/update_weights`` or ``/load``) that succeeded:
    once for ``"N"``, after the N-th and every later one for ``"N+"`` — weights that did not
    arrive as sent. Copies only: a replica computing on the trainer's memory (shared) is left."""
    when = s.get(os.environ.get("ATROPOSD_NAME", ""))
    if when is None:
        return
    nth, every = int(when.rstrip("+")), when.endswith("+")
    cls = module.TorchEngine
    count = 0

    async def corrupt(engine: Any) -> None:
        nonlocal count
        count += 1
        if count != nth and not (every and count > nth):
            return
        if engine.receiver is not None and engine.receiver.attached:
            return  # the trainer's own memory

        def add_noise() -> None:
            import torch

            gen = torch.Generator().manual_seed(1234 + count)
            with torch.no_grad():
                for p in engine.model.parameters():
                    noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
                    p.add_((noise * 0.5).to(device=p.device, dtype=p.dtype))

        async with engine._compute:
            await asyncio.to_thread(add_noise)
        _log("fault: the weights were corrupted after this update", update=count)

    for name in ("update_weights", "load_weights"):
        original = getattr(cls, name)

        def wrapped(original: Callable[..., Any]) -> Callable[..., Any]:
            async def method(self: Any, request: Any) -> Any:
                result = await original(self, request)
                await corrupt(self)
                return result

            return method

        setattr(cls, name, wrapped(original))


def _check_skip_weights(s: Any) -> None:
    ok = isinstance(s, dict) and all(isinstance(k, str) and isinstance(v, str) and v.isdigit() for k, v in s.items())
    if not ok:
        raise ValueError(f"skip_weights wants {{replica name: 'N'}}, got {s!r}")


def _patch_skip_weights(module: types.ModuleType, s: dict[str, str]) -> None:
    """The vLLM replica named NAME (``ATROPOSD_NAME``) leaves out the transfer of its N-th whole
    weight update (a push's one ``start`` and ``finish`` step of vLLM's weight-transfer
    lifecycle), once: the update is answered as done and the replica serves the new version's
    number with the old weights — weights that did not arrive."""
    when = s.get(os.environ.get("ATROPOSD_NAME", ""))
    if when is None:
        return
    nth = int(when)
    cls = module.VllmEngine
    original = cls._transfer
    count = 0

    async def transfer(self: Any, update_info: Any, *, start: bool, finish: bool) -> Any:
        nonlocal count
        if start and finish:
            count += 1
            if count == nth:
                _log("fault: this weight update's transfer was left out", update=count)
                return None
        return await original(self, update_info, start=start, finish=finish)

    cls._transfer = transfer


def _check_hold_resume(s: Any) -> None:
    seconds = s.get("seconds") if isinstance(s, dict) else None
    ok = isinstance(s, dict) and isinstance(s.get("dir"), str) and set(s) <= {"dir", "seconds"}
    if not ok or not (seconds is None or (isinstance(seconds, (int, float)) and seconds > 0)):
        raise ValueError(f"hold_resume wants {{'dir': path, 'seconds'?: number > 0}}, got {s!r}")


def _patch_hold_resume(module: types.ModuleType, s: dict[str, str]) -> None:
    """The weight sync holds a replica paused mid-swap: while the file ``DIR/hold`` exists, the
    sync's resume of a replica (after its pause and its weights, before it generates again)
    waits — ``seconds`` at most when given, as a slow transfer would; it creates ``DIR/held``
    (the replica's socket and the version) as it starts waiting and removes it as it goes on.
    With ``inflight = "keep"`` the replica's running generations stay frozen meanwhile."""
    import time

    cls = module.Replicas
    original = cls.reached
    hold, held = Path(s["dir"]) / "hold", Path(s["dir"]) / "held"
    limit = s.get("seconds")

    async def reached(self: Any, r: Any, version: int, method: str, *args: Any, **kwargs: Any) -> Any:
        if method == "resume" and hold.exists():
            held.write_text(f"{r.socket} {version}\n")
            _log("fault: the sync holds the replica paused before its resume", socket=str(r.socket), version=version)
            until = None if limit is None else time.monotonic() + float(limit)
            while hold.exists() and (until is None or time.monotonic() < until):  # noqa: ASYNC110 - a file says when
                await asyncio.sleep(0.02)
            held.unlink(missing_ok=True)
        return await original(self, r, version, method, *args, **kwargs)

    cls.reached = reached


# name → (the module it patches, the patch, the check of its setting)
FAULTS: dict[str, tuple[str, Callable[[types.ModuleType, Any], None], Callable[[Any], None]]] = {
    "stall_step": ("atroposd.trainer.loop", _patch_stall_step, _check_stall_step),
    "lr_burst": ("atroposd.trainer.loop", _patch_lr_burst, _check_lr_burst),
    "rank_hang": ("atroposd.trainer.follower", _patch_rank_hang, _check_rank_hang),
    "corrupt_weights": ("atroposd.inference.torch_engine", _patch_corrupt_weights, _check_corrupt_weights),
    "skip_weights": ("atroposd.inference.vllm_engine", _patch_skip_weights, _check_skip_weights),
    "hold_resume": ("atroposd.weights.replicas", _patch_hold_resume, _check_hold_resume),
}


def check(name: str, setting: Any) -> None:
    FAULTS[name][2](setting)


# --------------------------------------------------------------------------- the import hook


class _Patched(importlib.abc.Loader):
    """The module's own loader, then the patches."""

    def __init__(self, loader: Any, patches: Sequence[Callable[[types.ModuleType], None]]) -> None:
        self.loader = loader
        self.patches = patches

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename... : the module's loader's
        return getattr(self.loader, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self.loader.create_module(spec)  # type: ignore[no-any-return]

    def exec_module(self, module: types.ModuleType) -> None:
        self.loader.exec_module(module)
        for patch in self.patches:
            patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, patches: dict[str, list[Callable[[types.ModuleType], None]]]) -> None:
        self.patches = patches

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name not in self.patches:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Patched(spec.loader, self.patches.pop(name))
                return spec
        return None


def install(faults: dict[str, Any]) -> None:
    """Patch each fault's module when it is imported (sitecustomize calls this at start)."""
    patches: dict[str, list[Callable[[types.ModuleType], None]]] = {}
    for name, setting in faults.items():
        module, patch, check_setting = FAULTS[name]
        check_setting(setting)
        patches.setdefault(module, []).append(lambda m, p=patch, s=setting: p(m, s))
    sys.meta_path.insert(0, _Finder(patches))
