"""sd_notify without libsystemd: READY, STATUS, WATCHDOG, STOPPING, EXTEND_TIMEOUT_USEC.

``Notifier.from_environment()`` takes NOTIFY_SOCKET (and the watchdog variables) out of the
process environment, so no child inherits them: only the daemon's main process talks to
systemd (``NotifyAccess=main``).  Sending never raises and never blocks; a missing socket is not an error
(``atroposd start`` uses the same protocol to learn when its daemon is READY, and goes away).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import anyio

from atroposd.logs import get_logger

log = get_logger("atroposd.systemd")

_VARS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


@dataclass
class Notifier:
    """The daemon's link to its service manager (a no-op when it has none)."""

    address: str | None = None
    watchdog_usec: int = 0
    failures: int = 0
    _last_status: str = ""

    @classmethod
    def from_environment(cls) -> Notifier:
        address = os.environ.get("NOTIFY_SOCKET") or None
        usec = 0
        wd_pid = os.environ.get("WATCHDOG_PID")
        if os.environ.get("WATCHDOG_USEC", "").isdigit() and (not wd_pid or wd_pid == str(os.getpid())):
            usec = int(os.environ["WATCHDOG_USEC"])
        for var in _VARS:
            os.environ.pop(var, None)
        return cls(address=address, watchdog_usec=usec)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, *lines: str) -> bool:
        """Send ``KEY=VALUE`` lines as one datagram; False if it could not be delivered."""
        if not self.address:
            return False
        addr = self.address
        if addr.startswith("@"):
            addr = "\0" + addr[1:]
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                # Never block the event loop: a receiver that stops reading gets nothing more.
                sock.setblocking(False)
                sock.sendto("\n".join(lines).encode(), addr)
            return True
        except OSError as exc:
            self.failures += 1
            if self.failures == 1:
                log.debug("sd_notify not delivered", address=self.address, error=str(exc))
            return False

    def ready(self, status: str = "") -> bool:
        return self.notify("READY=1", *([f"STATUS={status}"] if status else []))

    def status(self, text: str) -> bool:
        if text == self._last_status:
            return True
        self._last_status = text
        return self.notify(f"STATUS={text}")

    def stopping(self, status: str = "") -> bool:
        return self.notify("STOPPING=1", *([f"STATUS={status}"] if status else []))

    def extend_timeout(self, seconds: float) -> bool:
        return self.notify(f"EXTEND_TIMEOUT_USEC={int(seconds * 1_000_000)}")

    async def watchdog_loop(self) -> None:
        """WATCHDOG=1 at half the interval, from the event loop: a stuck loop stops the pings."""
        if not self.watchdog_usec or not self.address:
            return
        interval = self.watchdog_usec / 2_000_000
        while True:
            self.notify("WATCHDOG=1")
            await anyio.sleep(interval)
