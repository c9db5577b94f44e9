"""Prints a numbered line of ~200 bytes every INTERVAL seconds until SIGTERM.  argv: [INTERVAL]"""

import signal
import sys
import time

signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
interval = float(sys.argv[1]) if len(sys.argv) > 1 else 0.05
n = 0
while True:
    print(f"tick {n:08d} " + "." * 180, flush=True)
    n += 1
    time.sleep(interval)  # the pace under test
