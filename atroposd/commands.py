"""The control commands: ``run``, ``start``, ``stop``, ``status``, ``reload``, ``logs``.

``run`` is the daemon itself (foreground).  The others are small clients of the control socket
and import nothing heavy: they must answer in well under a second.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, TextIO, cast

from atroposd import control
from atroposd.config import Config
from atroposd.exitcodes import Exit
from atroposd.paths import Paths, RuntimeDirError, private_umask
from atroposd.pyexec import python_module

if TYPE_CHECKING:
    from atroposd.progress import StatusPoller

FOLLOW_INTERVAL = 0.25


def _err(msg: str) -> None:
    print(f"atroposd: {msg}", file=sys.stderr)


# ----------------------------------------------------------------------------- run


class _Tee:
    """The daemon's log stream: stderr (journald, a terminal) and ``logs/daemon.log`` (rotated).

    ``stream`` None: the file only (a daemon started by ``atroposd start``, whose stderr is
    ``logs/daemon.out`` and keeps only what bypasses logging, such as a crash's traceback).
    """

    def __init__(self, stream: TextIO | None, path: Path, *, max_bytes: int, backups: int) -> None:
        from atroposd.process.logfiles import RotatingFile

        self._stream = stream
        self._file = RotatingFile(path, max_bytes=max_bytes, backups=backups)
        self._lock = threading.Lock()
        self._footer = ""  # a live line kept below the log on a terminal (stderr only)
        self._footer_drawn = False  # the cursor is on the footer's line
        self._line_open = False  # a log line was written without its newline yet

    def set_footer(self, text: str) -> None:
        """Show ``text`` as the terminal's last line, redrawn below each log line ("" = none)."""
        from atroposd.progress import ERASE

        with self._lock:
            if self._stream is None or text == self._footer:
                return
            self._footer = text
            if self._line_open:
                return  # a log line is being written: the footer follows its newline
            try:
                self._stream.write(ERASE + text)
                self._stream.flush()
                self._footer_drawn = bool(text)
            except (OSError, ValueError):
                self._stream = None

    def write(self, text: str) -> int:
        with self._lock:
            if self._stream is not None:
                try:
                    if self._footer or self._footer_drawn:
                        from atroposd.progress import ERASE

                        # the log line goes where the footer was; the footer follows each newline
                        self._stream.write((ERASE if self._footer_drawn else "") + text)
                        self._footer_drawn = False
                        self._line_open = not text.endswith("\n")
                        if self._footer and not self._line_open:
                            self._stream.write(self._footer)
                            self._footer_drawn = True
                    else:
                        self._stream.write(text)
                        self._line_open = not text.endswith("\n")
                except (OSError, ValueError):
                    # stderr went away (a closed pipe, a closed terminal): the file keeps the log.
                    self._stream = None
            try:
                self._file.write(text.encode())
            except OSError:
                pass  # a full disk must not stop the daemon; stderr still has it
        return len(text)

    def flush(self) -> None:
        if self._stream is not None:
            try:
                self._stream.flush()
            except (OSError, ValueError):
                self._stream = None

    def isatty(self) -> bool:
        return self._stream is not None and self._stream.isatty()


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), path.stat()
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _daemon_log_stream(cfg: Config) -> _Tee:
    paths = Paths.of(cfg)
    path = paths.log_file("daemon")
    path.parent.mkdir(parents=True, exist_ok=True)
    detached = _same_file(sys.stderr.fileno(), _daemon_out(paths))  # started by `atroposd start`
    return _Tee(
        None if detached else sys.stderr, path, max_bytes=cfg.daemon.log_max_bytes, backups=cfg.daemon.log_backups
    )


def _daemon_out(paths: Paths) -> Path:
    return paths.logs_dir / "daemon.out"


def run(cfg: Config, args: argparse.Namespace) -> int:
    from atroposd.daemon.core import run_foreground
    from atroposd.daemon.runtime import AlreadyRunning
    from atroposd.logs import configure_logging
    from atroposd.systemd import Notifier

    private_umask()  # state, logs and checkpoints are this user's only, as under the shipped unit
    notifier = Notifier.from_environment()
    try:
        stream = _daemon_log_stream(cfg)
    except OSError as exc:
        _err(f"cannot write the daemon log under {cfg.state_dir}: {exc}")
        return Exit.RUNTIME
    configure_logging(cfg.daemon.log_level, cfg.daemon.log_format, stream=cast(TextIO, stream), component="daemon")
    for w in cfg.warnings:
        _err(f"warning: {w}")
    try:
        Paths.of(cfg).ensure_runtime_dir()
    except (RuntimeDirError, OSError) as exc:
        _err(f"cannot use the runtime directory: {exc}")
        return Exit.RUNTIME
    poller = _progress_line(cfg, stream) if stream.isatty() else None
    try:
        return run_foreground(cfg, notifier)
    except AlreadyRunning as exc:
        _err(str(exc))
        return Exit.ALREADY_RUNNING
    except PermissionError as exc:
        _err(f"permission denied: {exc}")
        return Exit.RUNTIME
    finally:
        if poller is not None:
            poller.stop()
            stream.set_footer("")


def _progress_line(cfg: Config, stream: _Tee) -> StatusPoller:
    """On a terminal: one live progress line below the log, redrawn every second."""
    from atroposd.progress import StatusPoller, fit, run_line

    return StatusPoller(lambda: _status_or_none(cfg), lambda st: stream.set_footer(fit(run_line(st)))).start()


def _status_or_none(cfg: Config) -> dict[str, Any] | None:
    """The daemon's status, or None while it does not answer (for progress lines)."""
    try:
        answer = control.request(cfg.control_socket, {"cmd": "status"}, timeout=2.0)
    except (control.ControlError, OSError, ValueError):
        return None
    status = answer.get("status") if answer.get("ok") else None
    return status if isinstance(status, dict) else None


# ----------------------------------------------------------------------------- start


def _ping(cfg: Config) -> dict[str, Any] | None:
    try:
        return control.request(cfg.control_socket, {"cmd": "ping"}, timeout=5)
    except control.NotRunning:
        return None


def _start_budget(cfg: Config) -> float:
    from atroposd.daemon.specs import API_READY_TIMEOUT

    envs = max((e.ready_timeout for e in cfg.env), default=0.0)
    return API_READY_TIMEOUT + 2 * cfg.inference.ready_timeout + envs + 120


def start(cfg: Config, args: argparse.Namespace) -> int:
    """Start the daemon in the background; return once it is READY (0) or has failed."""
    try:
        running = _ping(cfg)
    except control.ControlError as exc:
        _err(str(exc))
        return exc.exit_code
    if running is not None:
        _err(f"a daemon is already running for this config (pid {running.get('pid')})")
        return Exit.ALREADY_RUNNING
    paths = Paths.of(cfg)
    log_path, out_path = paths.log_file("daemon"), _daemon_out(paths)
    private_umask()  # daemon.out, and the daemon it starts (which sets it again)
    paths.ensure_state_dirs()
    offset = log_path.stat().st_size if log_path.exists() else 0
    out_offset = out_path.stat().st_size if out_path.exists() else 0
    tmp = Path(tempfile.mkdtemp(prefix="atroposd-start-"))
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
    try:
        notify.bind(str(tmp / "notify"))
        # The daemon speaks sd_notify to us, as it would to systemd: READY=1 means READY.
        env = {k: v for k, v in os.environ.items() if k not in ("WATCHDOG_USEC", "WATCHDOG_PID")}
        env["NOTIFY_SOCKET"] = str(tmp / "notify")
        argv = [*python_module("atroposd"), "run"]
        if not cfg.source.startswith("<"):
            argv += ["-c", cfg.source]
        with open(out_path, "ab") as out:
            proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        return _await_ready(proc, notify, (log_path, offset), (out_path, out_offset), _start_budget(cfg), cfg)
    finally:
        notify.close()
        shutil.rmtree(tmp, ignore_errors=True)


class _StartProgress:
    """On a terminal: what the starting daemon waits for, on one line redrawn every second."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.started = time.monotonic()
        self.poller: StatusPoller | None = None
        self.shown = False
        self._lock = threading.Lock()
        if sys.stderr.isatty():
            from atroposd.progress import StatusPoller

            self.poller = StatusPoller(lambda: _status_or_none(cfg), self._show).start()

    def _show(self, st: dict[str, Any] | None) -> None:
        from atroposd.progress import ERASE, fit, start_line

        with self._lock:
            if self.poller is None:
                return
            sys.stderr.write(ERASE + fit(start_line(st, time.monotonic() - self.started)))
            sys.stderr.flush()
            self.shown = True

    def done(self) -> None:
        from atroposd.progress import ERASE

        if self.poller is None:
            return
        self.poller.stop()
        with self._lock:
            self.poller = None
            if self.shown:
                sys.stderr.write(ERASE)
                sys.stderr.flush()


def _await_ready(
    proc: subprocess.Popen[bytes],
    notify: socket.socket,
    log: tuple[Path, int],
    out: tuple[Path, int],
    budget: float,
    cfg: Config | None = None,
) -> int:
    progress = _StartProgress(cfg) if cfg is not None else None
    try:
        return _await_ready_quietly(proc, notify, log, out, budget, progress)
    finally:
        if progress is not None:
            progress.done()


def _await_ready_quietly(
    proc: subprocess.Popen[bytes],
    notify: socket.socket,
    log: tuple[Path, int],
    out: tuple[Path, int],
    budget: float,
    progress: _StartProgress | None,
) -> int:
    log_path = log[0]
    deadline = time.monotonic() + budget
    while time.monotonic() < deadline:
        ready, _, _ = select.select([notify], [], [], 0.2)
        if ready:
            lines = notify.recv(65536).decode(errors="replace").splitlines()
            if "READY=1" in lines:
                if progress is not None:
                    progress.done()
                print(f"atroposd: ready (pid {proc.pid}); logs: {log_path}")
                proc.returncode = 0  # the daemon outlives this command; nothing here waits for it
                return Exit.OK
            continue
        code = proc.poll()
        if code is not None:
            if progress is not None:
                progress.done()
            _err(f"the daemon failed to start (exit {code}): {_failure_reason(*log, *out)}")
            return code or Exit.RUNTIME
    if progress is not None:
        progress.done()
    _err(
        f"the daemon is not READY after {budget:g}s; it keeps starting in the background (pid {proc.pid}); "
        f"see {log_path}"
    )
    proc.returncode = 0
    return Exit.RUNTIME


def _read_from(path: Path, offset: int) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            return fh.read().decode(errors="replace")
    except OSError:
        return ""


def _failure_reason(log_path: Path, offset: int, out_path: Path, out_offset: int) -> str:
    """The daemon's own 'start failed' reason, else the last lines it wrote."""
    text = _read_from(log_path, offset)
    for line in text.splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict) and obj.get("event") == "start failed":
            return str(obj.get("reason"))
    lines = [ln for ln in (text + "\n" + _read_from(out_path, out_offset)).splitlines() if ln.strip()]
    return "\n" + "\n".join(lines[-20:]) if lines else "(nothing logged)"


# ----------------------------------------------------------------------------- stop / status / reload


def stop(cfg: Config, args: argparse.Namespace) -> int:
    """Ask the daemon to stop; wait until it (and so every child) is gone."""
    timeout = (
        args.timeout
        if getattr(args, "timeout", None) is not None
        else cfg.daemon.checkpoint_timeout + cfg.daemon.stop_timeout + 10
    )
    try:
        answer = control.request(cfg.control_socket, {"cmd": "stop"})
    except control.ControlError as exc:
        _err(str(exc))
        return exc.exit_code
    pid = int(answer["pid"])
    if not _wait_gone(pid, answer["start_time"], timeout):
        _err(f"the daemon (pid {pid}) is still stopping after {timeout:g}s")
        return Exit.STOP_TIMEOUT
    print(f"atroposd: stopped (pid {pid})")
    return Exit.OK


def _wait_gone(pid: int, start_time: int | float, timeout: float) -> bool:
    """Wait until the daemon (pid and start, :mod:`atroposd.pids`) has exited; a zombie counts:
    its parent may reap it late."""
    import psutil

    from atroposd.pids import same_process

    deadline = time.monotonic() + timeout
    try:
        proc = same_process(pid, start_time)
        if proc is None:
            return True
        while time.monotonic() < deadline:
            if proc.status() == psutil.STATUS_ZOMBIE or same_process(pid, start_time) is None:
                return True
            time.sleep(0.02)
    except psutil.NoSuchProcess:
        return True
    return False


def status(cfg: Config, args: argparse.Namespace) -> int:
    if getattr(args, "watch", False):
        return _watch_status(cfg, as_json=getattr(args, "json", False))
    node = getattr(args, "node", None)
    try:
        answer = control.request(cfg.control_socket, {"cmd": "status", **({} if node is None else {"node": node})})
    except control.ControlError as exc:
        _err(str(exc))
        return exc.exit_code
    if not answer.get("ok") or not isinstance(answer.get("status"), dict):
        _err(f"the daemon answered with an error: {answer.get('error')}")
        return Exit.RUNTIME
    st = answer["status"]
    if getattr(args, "json", False):
        print(json.dumps(st))
        return Exit.OK
    print(_render_status(st))
    return Exit.OK


WATCH_INTERVAL_S = 1.0
_CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear the screen


def _watch_status(cfg: Config, *, as_json: bool, interval: float = WATCH_INTERVAL_S) -> int:
    """``status --watch``: the status redrawn every ``interval`` until Ctrl-C (0) or the daemon
    is gone (its exit code). On a terminal each view replaces the last; otherwise (or with
    ``--json``: one object per line) the views follow each other."""
    tty = sys.stdout.isatty() and not as_json
    try:
        while True:
            started = time.monotonic()
            try:
                answer = control.request(cfg.control_socket, {"cmd": "status"})
            except control.ControlError as exc:
                _err(str(exc))
                return exc.exit_code
            st = answer.get("status")
            if not answer.get("ok") or not isinstance(st, dict):
                _err(f"the daemon answered with an error: {answer.get('error')}")
                return Exit.RUNTIME
            if as_json:
                text = json.dumps(st)
            else:
                stamp = time.strftime("%H:%M:%S")
                text = f"{_render_status(st)}\n\n{stamp}  every {interval:g}s; Ctrl-C to stop"
            sys.stdout.write((_CLEAR if tty else "") + text + ("\n" if tty or as_json else "\n\n"))
            sys.stdout.flush()
            time.sleep(max(0.0, interval - (time.monotonic() - started)))
    except KeyboardInterrupt:
        if tty:
            sys.stdout.write("\n")
        return Exit.OK


def _render_status(st: dict[str, Any]) -> str:
    from atroposd.progress import waiting_text

    out = [f"atroposd {st['state']}  pid {st['pid']}  up {st['uptime_s']:.0f}s  config {st['config']}"]
    out.append(f"{'COMPONENT':<24} {'STATE':<12} {'PID':>8} {'RESTARTS':>8}  LAST EXIT")
    for c in st.get("components") or []:
        last = c.get("last_exit")
        last_text = "" if not last else (last["signal"] or f"code {last['code']}") + f" at {last['at']}"
        if last and last.get("reason"):
            last_text = f"{last['reason']}: {last_text}"
        name = c["name"] + (" (external)" if c.get("external") else "")
        out.append(f"{name:<24} {c['state']:<12} {c['pid'] or '-':>8} {c['restarts']:>8}  {last_text}")
        live = c.get("live") or {}
        if live.get("state") in ("failing", "hung"):
            out.append(f"  {live['state']}: {live.get('error') or (live.get('last_hung') or {}).get('reason')}")
    replicas = [c for c in st.get("components") or [] if c.get("kind") == "inference" and "generations" in c]
    if len(replicas) > 1:
        out.append(
            "replicas: "
            + ", ".join(
                f"{c['name']} weights v{c.get('weight_version')}, {c.get('generations')} generations" for c in replicas
            )
        )
    t = st.get("trainer")
    if t:
        line = f"trainer: {t.get('state')} step {t.get('step')}/{t.get('total_steps')}"
        if t.get("waiting_for"):
            line += f" (waiting for {waiting_text(t['waiting_for'])})"
        if t.get("state") == "stalled":
            line += f" (no step for {t.get('stalled_for_s')}s; stuck: {t.get('stage_text') or t.get('stage')})"
        for key in ("reward_mean", "accuracy", "loss", "steps_per_s"):
            if t.get(key) is not None:
                line += f"  {key} {t[key]:.4g}"
        out.append(line)
        ranks = t.get("ranks") or 1
        if ranks > 1 or t.get("group_restarts"):
            restarts = t.get("group_restarts") or 0
            text = f"trainer: {ranks} ranks, {restarts} group restart{'' if restarts == 1 else 's'}"
            out.append(text + (f"; last fault: {t['last_fault']}" if t.get("last_fault") else ""))
        rejected = {k: v for k, v in (t.get("rejected_groups") or {}).items() if v}
        if rejected:
            out.append("trainer: rejected groups " + ", ".join(f"{k} {v}" for k, v in sorted(rejected.items())))
        if t.get("filtered_groups"):
            out.append(f"trainer: {t['filtered_groups']} groups filtered (all scores equal; filter_groups)")
        if t.get("health") not in (None, "ok"):
            out.append(f"trainer: health: {t['health']} tripped at the last step")
        last = t.get("last_rollback")
        if t.get("rollbacks") and isinstance(last, dict):
            out.append(
                f"trainer: {t['rollbacks']} rollback(s) of at most {t.get('max_rollbacks')}; last at step "
                f"{last.get('step')}: {last.get('reason')} → back to {last.get('to')}, lr now "
                f"{last.get('lr')}, {t.get('dropped_groups') or 0} groups dropped"
            )
        sen = t.get("sentinel")
        if isinstance(sen, dict):
            values = ["-" if d is None else f"{d:.3g}" for d in sen.get("replica_drift") or []]
            names = [str(n) for n in sen.get("replicas") or []]
            if len(names) == len(values) and not all(n.isdigit() for n in names):  # other nodes' replicas too
                values = [f"{n}: {v}" for n, v in zip(names, values, strict=True)]
            drift = ", ".join(values)
            text = (
                f"sentinel: drift [{drift}] (limit {sen.get('drift_limit')}), canary prompts "
                f"{sen.get('canary_prompts')} {sen.get('canary_source')}, {sen.get('resyncs') or 0} resyncs, "
                f"{sen.get('restarts') or 0} restarts"
            )
            held = sen.get("quarantined") or {}
            out.append(text + ("; quarantined: " + ", ".join(f"replica {k}" for k in sorted(held)) if held else ""))
        if t.get("checkpoint_failures"):
            out.append(
                f"trainer: {t['checkpoint_failures']} checkpoint write(s) failed; last: "
                f"{t.get('checkpoint_error') or '?'}"
            )
    q = st.get("queue")
    if q:
        out.append(f"queue: {q.get('sequences')} sequences" + (f" of {q['capacity']}" if q.get("capacity") else ""))
    out += _render_sandbox(st)
    out += _render_nodes(st)
    if st.get("truncated"):
        out.append(f"(cut to fit: {st['truncated']})")
    return "\n".join(out)


def _render_sandbox(st: dict[str, Any]) -> list[str]:
    """``[sandbox]``: each environment replica's live containers, the removals by reason."""
    sb = st.get("sandbox")
    if not isinstance(sb, dict):
        return []
    live = sb.get("containers") or {}
    line = "sandbox: " + (", ".join(f"{k} {v}" for k, v in sorted(live.items())) or "no environment") + " containers"
    removed = {k: v for k, v in (sb.get("removed") or {}).items() if v}
    if removed:
        line += "; removed " + ", ".join(f"{k} {v}" for k, v in sorted(removed.items()))
    refused = sb.get("refused") or {}
    if refused:
        line += "; refused " + ", ".join(f"{k} {v}" for k, v in sorted(refused.items()))
    out = [line]
    if sb.get("engine_error"):
        out.append(f"sandbox: the engine does not answer: {sb['engine_error']}")
    return out


def _render_nodes(st: dict[str, Any]) -> list[str]:
    """Several machines: the head lists every node and its components; another node its head."""
    nodes = st.get("nodes")
    if nodes:
        out = [f"{'NODE':<6} {'HOST':<20} {'STATE':<9} {'HEARTBEAT':>9}  COMPONENTS"]
        for n in nodes:
            beat = n.get("last_heartbeat_s")
            comps = ", ".join(f"{c.get('name')} {c.get('state')}" for c in n.get("components") or [])
            reason = f" ({n['reason']})" if n.get("reason") and n.get("state") != "ready" else ""
            out.append(
                f"{n['node_rank']:<6} {n.get('host') or '-'!s:<20} {n['state']:<9} "
                f"{'-' if beat is None else f'{beat:.1f}s':>9}  {comps or '-'}{reason}"
            )
        return out
    link = st.get("cluster")
    if link:
        return [f"node {link.get('node_rank')} of a cluster; head {link.get('head')} ({link.get('state')})"]
    return []


def reload(cfg: Config, args: argparse.Namespace) -> int:
    try:
        answer = control.request(cfg.control_socket, {"cmd": "reload"}, timeout=cfg.daemon.stop_timeout * 2 + 30)
    except control.ControlError as exc:
        _err(str(exc))
        return exc.exit_code
    if not answer.get("ok"):
        _err(str(answer.get("error")))
        return int(answer.get("code", Exit.USAGE))
    parts = [f"{k}: {', '.join(answer[k])}" for k in ("added", "removed", "changed") if answer.get(k)]
    print("atroposd: reloaded" + ("; " + "; ".join(parts) if parts else " (no environment changed)"))
    return Exit.OK


# ----------------------------------------------------------------------------- logs


def logs(cfg: Config, args: argparse.Namespace) -> int:
    paths = Paths.of(cfg)
    name = getattr(args, "name", None) or "daemon"
    try:
        path = paths.log_file(name)
    except ValueError as exc:
        _err(str(exc))
        return Exit.USAGE
    follow = bool(getattr(args, "follow", False))
    if follow:
        try:
            if _ping(cfg) is None:
                _err("no daemon is running for this config")
                return Exit.NOT_RUNNING
        except control.ControlError as exc:
            _err(str(exc))
            return exc.exit_code
    if not path.exists() and not follow:
        known = sorted(p.name[:-4] for p in paths.logs_dir.glob("*.log")) if paths.logs_dir.is_dir() else []
        _err(f"no log for {name!r} in {paths.logs_dir}" + (f" (known: {', '.join(known)})" if known else ""))
        return Exit.USAGE
    from atroposd.process.logfiles import tail

    lines = max(0, int(getattr(args, "lines", 50)))
    # Following goes on from exactly where the lines shown end: a line written in between is
    # shown once, not lost.
    start = path.stat().st_size if path.exists() else 0
    if lines and start:
        text = tail(path, max_lines=lines, max_bytes=max(8192, lines * 400), end=start)
        if text:
            print(text, flush=True)
    if not follow:
        return Exit.OK
    return _follow(cfg, path, start)


def _follow(cfg: Config, path: Path, pos: int) -> int:
    """Print what is appended to ``path`` from byte ``pos``, across rotation, until the daemon is gone."""
    fh = None
    inode = None
    last_ping = time.monotonic()
    try:
        while True:
            try:
                st = path.stat()
            except FileNotFoundError:
                st = None
            if st is not None and (fh is None or st.st_ino != inode or st.st_size < pos):
                if fh is not None:
                    _drain(fh)  # the rest of the rotated file
                    fh.close()
                    pos = 0
                fh = open(path, "rb")
                inode = st.st_ino
                fh.seek(pos)
            if fh is not None:
                pos += _drain(fh)
            if time.monotonic() - last_ping > 1.0:
                last_ping = time.monotonic()
                try:
                    gone = _ping(cfg) is None
                except control.PermissionDenied as exc:
                    _err(str(exc))
                    return exc.exit_code
                except control.ControlError:
                    # a daemon on its way out resets the connection, a busy one answers late:
                    # neither is gone yet, so ask again next time
                    gone = False
                if gone:
                    if fh is not None:
                        _drain(fh)
                    return Exit.OK
            time.sleep(FOLLOW_INTERVAL)
    finally:
        if fh is not None:
            fh.close()


def _drain(fh: BinaryIO) -> int:
    data = fh.read()
    if data:
        sys.stdout.write(data.decode(errors="replace"))
        sys.stdout.flush()
    return len(data)
