"""One rank of a two-rank gloo group formed through the daemon's store at an address (a file on
one machine, host:port with several): it joins, rank 0 sends a command and a share, rank 1
receives both, both sum their ranks; each prints one JSON line of what it saw.

    python -m tests.trainer.group_peer RANK ADDRESS PREFIX KEY_HEX
"""

from __future__ import annotations

import json
import sys


def main() -> int:
    import torch

    from atroposd.trainer.group import Compute, connect_store
    from atroposd.trainer.ranks import GroupRanks
    from tests.trainer.test_group import _micro

    rank, address, prefix, key = int(sys.argv[1]), sys.argv[2], sys.argv[3], bytes.fromhex(sys.argv[4])
    ranks = GroupRanks.join(
        connect_store(address, 30),
        prefix=prefix,
        key=key,
        rank=rank,
        world=2,
        device=torch.device("cpu"),
        join_timeout=30,
        collective_timeout=30,
    )
    try:
        ranks.settle()
        out: dict[str, object] = {"rank": rank}
        if rank == 0:
            ranks.command(Compute())
            ranks.share([_micro(1), _micro(2)], 10, 0)
        else:
            out["command"] = type(ranks.receive()).__name__
            share = ranks.receive_share()
            out["micro"] = len(share.micro)
        out["sum"] = ranks.sum([rank + 1.0])
        ranks.barrier()
        print(json.dumps(out), flush=True)
    finally:
        ranks.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
