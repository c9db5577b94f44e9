"""Runs until SIGTERM, then exits 0.  argv: [MARKER] — a line "<name> <monotonic>" is appended
to MARKER at start (start-order checks); ATROPOSD_* variables are printed for the tests."""

import os
import signal
import sys
import time


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if len(sys.argv) > 1:
        with open(sys.argv[1], "a") as fh:
            fh.write(f"{os.environ.get('ATROPOSD_NAME', '?')} {time.monotonic()}\n")
    env = {k: v for k, v in os.environ.items() if k.startswith("ATROPOSD_") or k in ("NOTIFY_SOCKET",)}
    print("env", sorted(env.items()), flush=True)
    while True:
        signal.pause()


if __name__ == "__main__":
    main()
