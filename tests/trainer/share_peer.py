"""One rank of a two-rank gloo group for the point-to-point timeout test: both join and settle
(``collective_timeout`` = TIMEOUT); then rank 1 never receives (it sleeps), and rank 0 sends it a
share and prints, as one JSON line, how long the send took and what it raised.

    python -m tests.trainer.share_peer RANK PORT TIMEOUT JOIN_TIMEOUT
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> int:
    import torch
    import torch.distributed as dist

    from atroposd.trainer.ranks import GroupRanks, is_group_error
    from tests.trainer.test_group import _micro

    rank, port, timeout, join_timeout = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, wait_for_workers=False)
    ranks = GroupRanks.join(
        store,
        prefix="share-test/",
        key=b"k" * 32,
        rank=rank,
        world=2,
        device=torch.device("cpu"),
        join_timeout=join_timeout,
        collective_timeout=timeout,
    )
    ranks.settle()
    if rank == 1:
        time.sleep(join_timeout + 30)  # never receives; the test kills it
        os._exit(0)
    started = time.monotonic()
    error = None
    try:
        ranks.share([_micro(1), _micro(2)], 10, 0)
    except Exception as exc:
        error = exc
    out = {
        "seconds": time.monotonic() - started,
        "error": None if error is None else str(error)[:300],
        "group_error": error is not None and is_group_error(error),
    }
    print(json.dumps(out), flush=True)
    os._exit(0)  # the group's teardown would wait for the silent peer


if __name__ == "__main__":
    sys.exit(main())
