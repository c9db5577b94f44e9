"""Ignores SIGTERM and leaves a grandchild in its own session (which ignores SIGTERM too).

argv: PIDFILE — "child_pid grandchild_pid" is written there once both run.
"""

import os
import signal
import subprocess
import sys


def main() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if sys.argv[1:2] == ["--grandchild"]:
        print("grandchild running", flush=True)
        while True:
            signal.pause()
    grandchild = subprocess.Popen([sys.executable, __file__, "--grandchild"], start_new_session=True)
    path = sys.argv[1]
    with open(path + ".tmp", "w") as fh:
        fh.write(f"{os.getpid()} {grandchild.pid}")
    os.replace(path + ".tmp", path)
    print(f"stubborn child {os.getpid()} with grandchild {grandchild.pid}", flush=True)
    while True:
        signal.pause()


if __name__ == "__main__":
    main()
