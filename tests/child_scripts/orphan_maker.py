"""Leaves short-lived orphans: an intermediate process starts a grandchild (own session) and
exits at once, so the grandchild is re-parented to the nearest subreaper; the grandchild exits
after DELAY seconds.  argv: PIDFILE [DELAY] — the grandchild pids are appended there.
Then runs until SIGTERM."""

import os
import signal
import subprocess
import sys

if sys.argv[1:2] == ["--intermediate"]:
    delay = sys.argv[2]
    grandchild = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({delay})"], start_new_session=True)
    print(grandchild.pid, flush=True)
    os._exit(0)

signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
pidfile, delay = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "0.3")
for _ in range(3):
    out = subprocess.run(
        [sys.executable, __file__, "--intermediate", delay], capture_output=True, text=True, check=True
    ).stdout
    with open(pidfile, "a") as fh:
        fh.write(out)
print("orphans made", flush=True)
while True:
    signal.pause()
