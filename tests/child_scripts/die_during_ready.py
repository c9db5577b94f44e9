"""Prints a reason and exits 3 while the daemon waits for it to become ready."""

import sys

print("die_during_ready: cannot open the thing it needs", flush=True)
sys.exit(3)
