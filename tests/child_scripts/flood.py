"""Writes to stdout as fast as it can, forever (until signalled)."""

import os
import signal
import sys

signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
line = (b"x" * 1023) + b"\n"
block = line * 64
out = sys.stdout.buffer
while True:
    out.write(block)
