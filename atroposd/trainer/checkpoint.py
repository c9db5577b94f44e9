"""Checkpoints: ``state_dir/checkpoints/step-<N>/``, written atomically (SPEC §9).

Layout (a Hugging Face directory plus the trainer's state)::

    step-N/config.json, model.safetensors     full mode (tied aliases stored once, as HF does)
    step-N/adapter_config.json, adapter_model.safetensors   LoRA mode (PEFT layout)
    step-N/tokenizer files
    step-N/trainer_state.pt   {"format", "step", "weight_version", "optimizer", "scheduler", "rng",
                               "config", "model", "mode", "tokenizer", "skipped_steps"}
    step-N/checksums.json     {"format", "files": {relative path: sha256}}, written last

``format`` is the layout's version: 2 now; 1 (written before several ranks wrote their own model
shards) still resumes. With several ranks the weights are shards under ``model/`` instead
(:mod:`.sharded`), and ``model.safetensors`` is there only at the last step.

Everything is written into ``.tmp-step-N-<pid>/``, the checksums of every file last, each file
fsync'ed, then the directory is renamed to ``step-N`` and the parent fsync'ed. A ``step-N``
directory therefore always is a complete checkpoint; a temporary one left by a crash or kill
is ignored and removed at the next start. Any failure while writing (a full disk raises
``SafetensorError`` or ``RuntimeError`` from safetensors and torch.save, not only
``OSError``) removes the temporary directory and is one ``CheckpointError``.

Never a moment without a complete checkpoint (SPEC §13): with ``keep > 1`` the oldest are
pruned *before* a write, keeping ``keep - 1`` (so a full disk has room); with ``keep = 1``
the old checkpoint goes only once the new one is in place. Writing a step that already has
a checkpoint exchanges the two directories atomically (``renameat2(RENAME_EXCHANGE)``;
where the file system lacks it, the old copy is renamed to ``.old-step-N-<pid>`` first and
put back at the next start if the new one never arrived) and only then removes the old copy.

What a checkpoint holds is taken between two steps; the files may then be written on a background
thread while training goes on (:class:`atroposd.trainer.setup.Checkpointer`): ``weights`` are a
private copy then, never the live tensors.

Resume (:func:`load_latest`) verifies the checksums of the newest complete checkpoint; one
that fails (or cannot be read) is set aside as ``step-N.bad-<time>`` — kept for a look,
never used again — and the next older is tried. A checkpoint of several ranks (``optimizer/``)
is loaded only when its checksums cover every file of it, and its optimizer directory is
always ``optimizer`` (:mod:`.sharded`): one without checksums, or naming another directory,
is set aside the same way.

The reference model of ``kl_reference = "initial"`` is not stored: it is the model source
itself (the configured directory, or builtin:tiny rebuilt from the seed), which resume checks
is unchanged (``model`` and ``tokenizer`` fingerprints in the state).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import errno
import hashlib
import json
import os
import random
import re
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
import torch

from atroposd.fsutil import fsync_dir

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase
from atroposd.trainer.ckptfiles import CHECKSUM_FILE, CheckpointError

__all__ = [
    "FORMAT_VERSION",
    "READABLE_FORMATS",
    "CheckpointError",
    "Latest",
    "Restored",
    "clean_partial",
    "complete_checkpoints",
    "is_known_good",
    "latest_checkpoint",
    "load_checkpoint",
    "load_latest",
    "mark_known_good",
    "newest_known_good",
    "prepare_checkpoint",
    "prune",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
    "verify_checksums",
]

log = structlog.get_logger("trainer", component="trainer")  # lazy: bound at first use

FORMAT_VERSION = 2
# The layouts this atroposd reads: 1 (the weights of several ranks gathered into
# model.safetensors) and 2 (each rank's model shards under model/).
READABLE_FORMATS = (1, 2)
STATE_FILE = "trainer_state.pt"
WEIGHTS_FILE = "model.safetensors"
_STEP_RE = re.compile(r"^step-(\d+)$")
TMP_PREFIX = ".tmp-step-"
OLD_PREFIX = ".old-step-"  # the previous copy of a step being written again (fallback path only)
_OLD_RE = re.compile(r"^\.old-step-(\d+)-\d+$")


@dataclass
class Restored:
    path: Path
    state: dict[str, Any]  # trainer_state.pt
    weights: dict[str, torch.Tensor]  # full: model state dict; LoRA: adapter tensors (PEFT names)


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every complete checkpoint under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        m = _STEP_RE.match(entry.name)
        if m and entry.is_dir() and (entry / STATE_FILE).is_file():
            found.append((int(m.group(1)), entry))
    return sorted(found)


def latest_checkpoint(root: Path) -> Path | None:
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def clean_partial(root: Path) -> list[Path]:
    """Remove temporary directories left by an interrupted write; returns what was removed.

    The previous copy of a step that was being written again (``.old-step-N-<pid>``) is put
    back as ``step-N`` when the new copy never arrived, and removed when it did.
    """
    removed = []
    if root.is_dir():
        for entry in sorted(root.iterdir()):
            m = _OLD_RE.match(entry.name)
            if m and not (root / f"step-{m.group(1)}").exists():
                try:
                    os.rename(entry, root / f"step-{m.group(1)}")
                    log.warning(
                        "restored the previous copy of an interrupted checkpoint", path=str(root / f"step-{m.group(1)}")
                    )
                except OSError as exc:  # left where it is: never removed while it may be the only copy
                    log.error("cannot restore the previous copy of a checkpoint", path=str(entry), error=str(exc))
            elif m or entry.name.startswith(TMP_PREFIX):
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
    return removed


KNOWN_GOOD_FILE = "known_good.json"  # written into a checkpoint once it proved healthy (SPEC §15)


def mark_known_good(path: Path, info: dict[str, Any]) -> None:
    """Mark the checkpoint ``path`` known-good: ``known_good.json`` (written atomically, after the
    checkpoint's checksums, which do not cover it: a small JSON file, never unpickled)."""
    tmp = path / f".{KNOWN_GOOD_FILE}.tmp"
    tmp.write_text(json.dumps(info, sort_keys=True) + "\n")
    os.replace(tmp, path / KNOWN_GOOD_FILE)
    fsync_dir(path)


def is_known_good(path: Path) -> bool:
    return (path / KNOWN_GOOD_FILE).is_file()


def newest_known_good(root: Path) -> Path | None:
    """The newest complete checkpoint marked known-good (None: only the starting weights are)."""
    for _step, path in reversed(complete_checkpoints(root)):
        if is_known_good(path):
            return path
    return None


def prune(root: Path, keep: int, *, spare: Path | None = None) -> None:
    """Keep the ``keep`` newest complete checkpoints (``keep`` may be 0), and ``spare`` always;
    the newest known-good one is never removed (beside the ``keep``: SPEC §15)."""
    good = newest_known_good(root)
    found = [(s, p) for s, p in complete_checkpoints(root) if p != spare and p != good]
    if spare is not None and spare.is_dir():
        keep -= 1
    for _, path in found[: max(0, len(found) - keep)]:
        shutil.rmtree(path, ignore_errors=True)


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def model_weights(model: torch.nn.Module, *, copy: bool = True) -> dict[str, torch.Tensor]:
    """The full model's state dict for safetensors, each storage once.

    Tied aliases (``lm_head.weight`` of a tied-embedding model) are dropped as Hugging Face
    does. With ``copy`` (the default) private contiguous copies, detached from shared memory
    that the inference server computes on; without, the live tensors detached (a CPU copy only
    of what is not on the CPU or not contiguous), for a writer the next optimizer step waits on.
    """
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, tuple[int, ...], torch.dtype]] = set()
    for name, t in model.state_dict().items():
        key = (t.data_ptr(), tuple(t.shape), t.dtype)
        if key in seen:
            continue
        seen.add(key)
        out[name] = t.detach().to("cpu", copy=copy).contiguous()
    return out


def _fsync_tree(path: Path) -> None:
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


HASH_THREADS = 4  # files hashed at once (hashlib releases the GIL on large reads)
BACKGROUND_NICE = 10  # the hashing threads of a checkpoint written in the background


def lower_priority() -> None:
    """This thread yields the CPU to training (Linux: a thread's own nice value)."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)


def _write_checksums(path: Path, *, low_priority: bool = False) -> None:
    """``checksums.json``: the sha256 of every file under ``path`` (written last); several files
    are hashed at once — with ``low_priority`` (a checkpoint written in the background, whose
    weights were read already) by threads that yield the CPU to training."""
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.name != CHECKSUM_FILE)
    workers = max(1, min(HASH_THREADS, len(files), os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(
        workers, thread_name_prefix="atroposd-checksum", initializer=lower_priority if low_priority else None
    ) as pool:
        digests = list(pool.map(_sha256, files))
    table = {str(f.relative_to(path)): d for f, d in zip(files, digests, strict=True)}
    (path / CHECKSUM_FILE).write_text(json.dumps({"format": 1, "files": table}, indent=1) + "\n")


def verify_checksums(path: Path) -> bool:
    """Check every file against ``checksums.json``; raises CheckpointError naming the first
    difference. Returns False when the checkpoint has no checksums (written before they were)."""
    table_file = path / CHECKSUM_FILE
    if not table_file.exists():
        return False
    try:
        table = json.loads(table_file.read_text())["files"]
        if not isinstance(table, dict) or STATE_FILE not in table:
            raise ValueError("no checksum of the trainer state")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint {path}: unreadable {CHECKSUM_FILE}: {exc}") from exc
    for name, expected in table.items():
        file = path / str(name)
        try:
            actual = _sha256(file)
        except OSError as exc:
            raise CheckpointError(f"checkpoint {path}: cannot read {name}: {exc.strerror or exc}") from exc
        if actual != expected:
            raise CheckpointError(f"checkpoint {path}: {name} does not match its checksum")
    return True


# renameat2(2)'s RENAME_EXCHANGE: swap two directory entries atomically (Linux ≥ 3.15).
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap ``a`` and ``b``; False where the system cannot (then nothing happened)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _install(tmp: Path, final: Path) -> None:
    """Rename the complete ``tmp`` to ``final``; an existing ``final`` goes only after that."""
    if not final.exists():
        os.rename(tmp, final)
        return
    if _exchange(tmp, final):
        shutil.rmtree(tmp, ignore_errors=True)  # now the previous copy
        return
    old = final.with_name(f"{OLD_PREFIX}{final.name.removeprefix('step-')}-{os.getpid()}")
    shutil.rmtree(old, ignore_errors=True)
    os.rename(final, old)  # a crash here: clean_partial puts ``old`` back
    try:
        os.rename(tmp, final)
    except OSError:
        os.rename(old, final)
        raise
    shutil.rmtree(old, ignore_errors=True)


def prepare_checkpoint(root: Path, step: int, keep: int) -> Path:
    """The empty temporary directory of ``step``'s checkpoint (room made first: with ``keep > 1``
    the oldest are pruned to ``keep - 1``; with ``keep = 1`` the only checkpoint stays until the
    new one is in place). Raises CheckpointError."""
    final = root / f"step-{step}"
    tmp = root / f"{TMP_PREFIX}{step}-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        if keep > 1:
            prune(root, keep - 1, spare=final)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    except OSError as exc:
        raise CheckpointError(f"cannot write checkpoint {final}: {exc.strerror or exc}") from exc
    return tmp


def save_checkpoint(
    root: Path,
    step: int,
    *,
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    lora: bool,
    state: dict[str, Any],
    keep: int,
    shards: Callable[[Path], dict[str, torch.Tensor] | None] | None = None,
    weights: dict[str, torch.Tensor] | None = None,
    prepared: Path | None = None,
    abandoned: threading.Event | None = None,
    read_done: Callable[[], None] | None = None,
    low_priority: bool = False,
) -> Path:
    """Write ``root/step-<step>/`` atomically; raises CheckpointError (temp dir removed).

    ``weights``: the full model's tensors to write (a copy taken between two steps), instead of
    the model's own. ``shards`` (several trainer ranks): called with the temporary directory once
    it exists; every rank writes its shards there; what it returns (the gathered weights of format
    1, or None: the shards are the weights) is written as ``model.safetensors``. ``prepared``: the
    temporary directory, made by :func:`prepare_checkpoint` already. ``abandoned`` set before the
    rename: the checkpoint is dropped, never installed (the trainer group restarted meanwhile).
    ``read_done``: called once the model's tensors and the state are written (what follows reads
    only the files). ``low_priority`` (written in the background): the files are hashed by
    threads that yield the CPU to training."""
    final = root / f"step-{step}"
    tmp = prepared if prepared is not None else root / f"{TMP_PREFIX}{step}-{os.getpid()}"
    try:
        if prepared is None:
            prepare_checkpoint(root, step, keep)
        if shards is not None:
            _write_model(tmp, model, lora, weights=shards(tmp), sharded=True)
        else:
            _write_model(tmp, model, lora, weights=weights)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        torch.save({"format": FORMAT_VERSION, "step": step, **state}, tmp / STATE_FILE)
        if read_done is not None:
            read_done()
        _write_checksums(tmp, low_priority=low_priority)  # last: a checkpoint with checksums was written in full
        _fsync_tree(tmp)
        if abandoned is not None and abandoned.is_set():
            raise CheckpointError("abandoned: the trainer group restarted while it was written")
        _install(tmp, final)
        fsync_dir(root)
    except Exception as exc:  # safetensors and torch.save report a full disk as their own errors
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, CheckpointError):
            if str(exc).startswith("cannot write checkpoint"):
                raise
            raise CheckpointError(f"cannot write checkpoint {final}: {exc}") from (exc.__cause__ or exc)
        if isinstance(exc, OSError):
            reason = "no space left on the device" if exc.errno == errno.ENOSPC else (exc.strerror or str(exc))
        else:
            reason = f"{type(exc).__name__}: {exc}"
            if "No space left" in str(exc) or "os error 28" in str(exc):
                reason = f"no space left on the device ({reason})"
            with contextlib.suppress(OSError):  # torch.save says "unexpected pos": say how full it is
                reason += f" ({shutil.disk_usage(root).free} bytes free on the device)"
        raise CheckpointError(f"cannot write checkpoint {final}: {reason}") from exc
    prune(root, keep)
    return final


def _write_model(
    path: Path,
    model: torch.nn.Module,
    lora: bool,
    weights: dict[str, torch.Tensor] | None = None,
    *,
    sharded: bool = False,
) -> None:
    """The model's files: its weights (unless ``sharded`` and no ``weights``: the shards are
    them), config and generation config."""
    from safetensors.torch import save_file

    if lora:
        # PEFT's own layout (adapter_config.json + adapter_model.safetensors); the base model is
        # the configured source and is not copied.
        model.save_pretrained(str(path))  # type: ignore[operator]
        return
    if weights is not None or not sharded:
        save_file(
            model_weights(model) if weights is None else weights, str(path / WEIGHTS_FILE), metadata={"format": "pt"}
        )
    config = getattr(model, "config", None)
    if config is not None:
        config.save_pretrained(str(path))
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        try:
            gen.save_pretrained(str(path))
        except ValueError as exc:  # an invalid generation config must not lose the checkpoint
            log.warning("generation config not saved", error=str(exc))


@dataclass
class Latest:
    """What :func:`load_latest` found: the restored checkpoint (or None) and what it set aside."""

    restored: Restored | None
    set_aside: list[Path] = field(default_factory=list)


def load_latest(root: Path) -> Latest:
    """The newest complete checkpoint that verifies and loads; bad ones are set aside.

    A checkpoint whose checksums differ or whose files cannot be read is renamed to
    ``step-N.bad-<unix time>`` (logged) and the next older one is tried. A checkpoint of
    another format version is an error, not a fallback (a newer atroposd wrote it).
    """
    result = Latest(restored=None)
    for _step, path in reversed(complete_checkpoints(root)):
        try:
            verified = verify_checksums(path)
            _check_sharded(path, verified)
            restored = load_checkpoint(path)
            if (restored.state.get("optimizer_dcp") or restored.state.get("model_dcp")) and not verified:
                raise CheckpointError(f"checkpoint {path}: a sharded checkpoint without {CHECKSUM_FILE} is not loaded")
        except CheckpointError as exc:
            if "has format" in str(exc):
                raise
            aside = path.with_name(f"{path.name}.bad-{int(time.time())}")
            try:
                os.rename(path, aside)
            except OSError as rename_exc:
                raise CheckpointError(f"{exc}; and it cannot be set aside: {rename_exc}") from exc
            result.set_aside.append(aside)
            log.error(
                "checkpoint is damaged: set aside, trying the next older one",
                path=str(path),
                moved_to=str(aside),
                error=str(exc),
            )
            continue
        if not verified:
            log.warning("checkpoint has no checksums (written by an older atroposd): not verified", path=str(path))
        result.restored = restored
        return result
    return result


def _check_sharded(path: Path, verified: bool) -> None:
    """Several ranks' checkpoint: verified in full before DCP reads anything (:mod:`.sharded`)."""
    from atroposd.trainer.sharded import check_verified

    table = None
    if verified:
        table = json.loads((path / CHECKSUM_FILE).read_text())["files"]
    check_verified(path, table)


def load_checkpoint(path: Path) -> Restored:
    """The trainer state and the full weights of a checkpoint (format 1 or 2, any rank count);
    the caller verified its checksums."""
    from safetensors.torch import load_file

    from atroposd.trainer.sharded import MODEL_DIR, check_optimizer_path, load_model_shards

    try:
        state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch.load errors of a damaged file are of many kinds
        raise CheckpointError(f"cannot read checkpoint {path}: {type(exc).__name__}: {exc}") from exc
    if not isinstance(state, dict) or state.get("format") not in READABLE_FORMATS:
        found = state.get("format") if isinstance(state, dict) else None
        raise CheckpointError(
            f"checkpoint {path} has format {found!r}; this atroposd reads "
            f"formats {', '.join(map(str, READABLE_FORMATS))}"
        )
    check_optimizer_path(path, state)
    if state.get("model_dcp"):
        shapes = state.get("model_shapes")
        return Restored(
            path=path,
            state=state,
            weights=load_model_shards(path / MODEL_DIR, shapes if isinstance(shapes, dict) else None),
        )
    try:
        lora = state.get("mode") == "lora"
        weights = load_file(str(path / ("adapter_model.safetensors" if lora else WEIGHTS_FILE)))
    except Exception as exc:  # safetensors errors of a damaged file are of many kinds
        raise CheckpointError(f"cannot read checkpoint {path}: {type(exc).__name__}: {exc}") from exc
    return Restored(path=path, state=state, weights=weights)


def restore_weights(model: torch.nn.Module, restored: Restored, *, lora: bool) -> None:
    """Copy the checkpoint's tensors into ``model`` (strict: every tensor present, nothing extra)."""
    if lora:
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(model, restored.weights)
        unexpected = list(getattr(result, "unexpected_keys", []) or [])
        if unexpected:
            raise CheckpointError(f"checkpoint {restored.path}: adapter tensors not in the model: {unexpected[:5]}")
        return
    result = model.load_state_dict(restored.weights, strict=False)
    own = model.state_dict()
    missing = [
        k
        for k in result.missing_keys
        if not any(own[k].data_ptr() == own[o].data_ptr() for o in restored.weights if o in own)
    ]
    if missing or result.unexpected_keys:
        raise CheckpointError(
            f"checkpoint {restored.path} does not match the model: missing {missing[:5]}, "
            f"unexpected {list(result.unexpected_keys)[:5]}"
        )
