"""Maps shared-memory segments and never unlinks them, like an engine killed before its cleanup.

argv: MARKER NAME...   each NAME is created in /dev/shm (unless it exists) and mapped; with
``--grandchild`` first, a grandchild in the same process group maps the same names too (vLLM's
EngineCore maps the queues its front maps). Ignores SIGTERM. MARKER is written once all are mapped.
"""

import mmap
import os
import signal
import subprocess
import sys


def hold(names: list[str]) -> list[mmap.mmap]:
    maps = []
    for name in names:
        path = f"/dev/shm/{name}"
        try:  # size a segment it creates; attach to one that exists, as shared memory is used
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, 1 << 16)
        except FileExistsError:
            fd = os.open(path, os.O_RDWR)
        maps.append(mmap.mmap(fd, os.fstat(fd).st_size))
        os.close(fd)
    return maps


def main() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    args = sys.argv[1:]
    grandchild = args[:1] == ["--grandchild"]
    if grandchild:
        args = args[1:]
    marker, names = args[0], args[1:]
    held = hold(names)
    if grandchild:
        sub = subprocess.Popen([sys.executable, __file__, marker + ".sub", *names])
        while not os.path.exists(marker + ".sub"):
            os.sched_yield()
        print(f"grandchild {sub.pid}", flush=True)
    with open(marker + ".tmp", "w") as fh:
        fh.write(str(os.getpid()))
    os.replace(marker + ".tmp", marker)
    print(f"holding {len(held)} segments", flush=True)
    while True:
        signal.pause()


if __name__ == "__main__":
    main()
