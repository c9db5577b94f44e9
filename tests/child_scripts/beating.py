"""A child that sends a heartbeat (atroposd.heartbeat) every 0.1 s from its event loop, as a
built-in environment does.  SIGSTOP it and the beats stop.

argv: NAME (the socket comes from ATROPOSD_HEARTBEAT)
"""

import signal
import sys

import anyio

from atroposd.heartbeat import HeartbeatSender

signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
anyio.run(
    HeartbeatSender.from_environ(sys.argv[1], {**__import__("os").environ, "ATROPOSD_HEARTBEAT_INTERVAL": "0.1"}).run
)
