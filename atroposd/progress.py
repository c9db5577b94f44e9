"""Progress where people wait, on a terminal only (off one, the output is unchanged).

``atroposd start`` shows what the daemon is waiting for (the component and the seconds so
far) until READY; ``atroposd run`` keeps one live line — step / total, steps/s, reward,
accuracy, time left — at the bottom of the terminal, below the log lines that scroll above
it. Both read the daemon's ``status`` (the caller's ``fetch``: over the control socket) once a
second. Nothing heavy is imported here (control commands start in well under a second).
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["ERASE", "StatusPoller", "run_line", "start_line"]

ERASE = "\r\x1b[K"  # to the line's start, erase it
POLL_INTERVAL_S = 1.0


def _duration(seconds: float) -> str:
    s = int(max(0, seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def fit(text: str, width: int | None = None) -> str:
    """``text`` cut to the terminal's width (a line that wraps cannot be erased)."""
    cols = width or shutil.get_terminal_size((100, 24)).columns
    return text if len(text) < cols else text[: max(1, cols - 2)] + "…"


def _waiting(st: dict[str, Any]) -> str | None:
    """What a starting job waits for: the first component not ready, else the trainer."""
    comps = st.get("components") or []
    for c in comps:
        if c.get("state") in ("starting", "backoff", "unreachable"):
            since = c.get("since_s")
            when = f", {_duration(since)}" if isinstance(since, (int, float)) else ""
            return f"{c.get('name')} ({c.get('state')}{when})"
    t = st.get("trainer") or {}
    if t.get("state") == "waiting" and t.get("waiting_for"):
        return f"the trainer (waiting for {waiting_text(t['waiting_for'])})"
    return None


# What the trainer waits for (``waiting_for``), as a person reads it after "waiting for".
_WAITING_TEXT = {
    "ranks": "the trainer ranks to form the group",
    "filtered": "data: the groups received lately had equal scores (dropped by filter_groups)",
}


def waiting_text(reason: str) -> str:
    """``waiting_for`` of the trainer's status as words (``ranks``: the group forming)."""
    return _WAITING_TEXT.get(reason, reason)


def start_line(st: dict[str, Any] | None, elapsed: float) -> str:
    """``atroposd start``'s line: what the daemon waits for, and for how long so far."""
    if st is None:
        return f"atroposd: starting the daemon… {_duration(elapsed)}"
    comps = st.get("components") or []
    ready = sum(c.get("state") == "ready" for c in comps)
    what = _waiting(st)
    text = f"atroposd: {st.get('state', 'starting')} {ready}/{len(comps)} components ready"
    if what:
        text += f"; waiting for {what}"
    return text + f" — {_duration(elapsed)}"


def run_line(st: dict[str, Any] | None) -> str:
    """``atroposd run``'s live line: step / total, steps/s, reward, accuracy, time left."""
    if st is None:
        return "atroposd: starting…"
    t = st.get("trainer")
    if not t:
        return start_line(st, float(st.get("uptime_s") or 0))
    step, total = int(t.get("step") or 0), int(t.get("total_steps") or 0)
    if t.get("state") == "waiting" and step == 0:
        what = _waiting(st)
        return f"atroposd: step 0/{total} — waiting for {what or 'data'}"
    width = 20
    done = min(width, int(width * step / total)) if total else 0
    text = f"step {step}/{total} [{'#' * done}{'.' * (width - done)}]"
    rate = t.get("steps_per_s")
    if isinstance(rate, (int, float)) and rate > 0:
        text += f"  {rate:.2f} steps/s"
    for key, label in (("reward_mean", "reward"), ("accuracy", "accuracy")):
        if isinstance(t.get(key), (int, float)):
            text += f"  {label} {t[key]:.3f}"
    if isinstance(rate, (int, float)) and rate > 0 and total > step:
        text += f"  left {_duration((total - step) / rate)}"
    if t.get("state") not in ("training", "waiting"):
        text += f"  ({t.get('state')})"
    elif t.get("state") == "waiting" and t.get("waiting_for"):
        text += f"  (waiting for {waiting_text(t['waiting_for'])})"
    return text


class StatusPoller:
    """Calls ``show(fetch())`` every ``interval`` from a thread until :meth:`stop`; ``fetch``
    answers the daemon's status, or None while there is none (it must not raise)."""

    def __init__(
        self,
        fetch: Callable[[], dict[str, Any] | None],
        show: Callable[[dict[str, Any] | None], None],
        *,
        interval: float = POLL_INTERVAL_S,
    ) -> None:
        self.fetch = fetch
        self.show = show
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="progress", daemon=True)

    def start(self) -> StatusPoller:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                status = self.fetch()
                if not self._stop.is_set():
                    self.show(status)
            except Exception:  # a progress line must never take anything down
                pass
            self._stop.wait(self.interval)
