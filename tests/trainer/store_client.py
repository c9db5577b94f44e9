"""A client of the trainer group's store that holds only its address (SPEC §12.1's threat): it
lists the keys, finds the newest command key of each prefix and writes at the next one, in turn,
a pickle that would create MARKER when unpickled, a JSON command without the group's key, and a
replay of the newest command's own value; each stays a moment so that a waiting rank reads it.

    python -m tests.trainer.store_client HOST:PORT|STORE_FILE MARKER
"""

from __future__ import annotations

import datetime
import os
import pickle
import re
import sys
import time


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def main() -> int:
    import torch.distributed as dist

    address, marker = sys.argv[1], sys.argv[2]
    from atroposd.trainer.group import command_box

    box = command_box(address)
    if box is not None:  # one machine: the commands are files beside the store's (this client runs as the same user)
        seqs = [int(n[4:]) for n in os.listdir(box.directory) if re.fullmatch(r"cmd-\d+", n)]
        if not seqs:
            print("no command keys found", file=sys.stderr)
            return 2
        seq = max(seqs)
        replay = box.get(f"cmd/{seq}")
        for value in (
            pickle.dumps(("stop", _Payload(marker))),
            b"0" * 64 + b'.{"seq":%d,"op":"stop","args":{}}' % (seq + 1),
            replay,
        ):
            box.set(f"cmd/{seq + 1}", value)
            time.sleep(0.4)
        print("wrote at the next command key")
        return 0
    if address.startswith("/"):  # one machine: the store's file (this client runs as the same user)
        store = dist.FileStore(address, -1)
        store.set_timeout(datetime.timedelta(seconds=10))
    else:
        host, _, port = address.rpartition(":")
        store = dist.TCPStore(host, int(port), is_master=False, use_libuv=False, timeout=datetime.timedelta(seconds=10))
    newest: dict[str, int] = {}
    for key in store.list_keys():
        m = re.fullmatch(r"(.*/)cmd/(\d+)", key)
        if m:
            newest[m[1]] = max(newest.get(m[1], 0), int(m[2]))
    if not newest:
        print("no command keys found", file=sys.stderr)
        return 2
    for prefix, seq in newest.items():
        replay = store.get(f"{prefix}cmd/{seq}")
        target = f"{prefix}cmd/{seq + 1}"
        for value in (
            pickle.dumps(("stop", _Payload(marker))),
            b"0" * 64 + b'.{"seq":%d,"op":"stop","args":{}}' % (seq + 1),
            replay,
        ):
            store.set(target, value)
            time.sleep(0.4)
    print(f"wrote at the next command key of {len(newest)} prefix(es)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
