"""The trainer group's meeting point, hosted by the daemon (SPEC §12.1).

``GroupStore`` binds a socket itself (loopback on one node) and hands it to a c10d TCPStore
(``master_listen_fd``): a TCPStore given 127.0.0.1 would otherwise listen on every interface.
Each (re)formed group gets a new generation; its ranks meet under a fresh prefix
(``ranks.store_keys``), so a rank of an abandoned group can never answer for the new one.
Store keys start with a secret (the daemon's launch nonce on one node).
"""

from __future__ import annotations

import datetime
import socket
from typing import Any

from atroposd.trainer.follower import generation_key
from atroposd.trainer.ranks import store_keys

__all__ = ["GroupStore"]

# The store's own timeout for a get or wait by the daemon's side (joins have their own deadline).
STORE_TIMEOUT_S = 600.0


class GroupStore:
    def __init__(self, *, secret: str, world: int, host: str = "127.0.0.1", port: int = 0,
                 advertise: str | None = None) -> None:
        import torch.distributed as dist

        self.secret = secret
        self.world = world
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        host = host if host != "0.0.0.0" else ""
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(256)
            # the address the ranks connect to: the bound host, or (a wildcard bind) ``advertise``
            self.host, self.port = advertise or host or "127.0.0.1", int(sock.getsockname()[1])
            self.store: Any = dist.TCPStore(self.host, self.port, is_master=True, master_listen_fd=sock.fileno(),
                                            wait_for_workers=False, use_libuv=False,
                                            timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))
        except BaseException:
            sock.close()
            raise
        # The store's server owns the listening socket now: closing it under the server's poll
        # would abort the process. It goes with the store (at the latest, with this process).
        sock.detach()
        self.generation = 0

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def next_generation(self) -> str:
        """Start a new group generation; returns its store prefix."""
        self.generation += 1
        self.store.set(generation_key(self.secret), str(self.generation))
        return store_keys(self.secret, self.generation)

    def joined(self, rank: int) -> bool:
        """Has ``rank`` joined the current generation's process group?"""
        import torch.distributed as dist

        if self.store is None:
            return False
        scoped = dist.PrefixStore(store_keys(self.secret, self.generation), self.store)
        return bool(scoped.check([f"joined/{rank}"]))

    def close(self) -> None:
        self.store = None
