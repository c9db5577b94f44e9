"""Address facts shared by every layer: which hosts are loopback.

A leaf module (standard library only).
"""

from __future__ import annotations

import ipaddress

LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})


def is_loopback(host: str | None) -> bool:
    """True for a loopback name or address: ``localhost``, 127.0.0.0/8, ``::1``.

    Accepts an IPv6 address in brackets or with a zone (``[::1]``, ``fe80::1%lo``) and a
    trailing dot on a name. Anything else (a host name, an empty string, None) is not loopback.
    """
    if not host:
        return False
    h = host.strip().lower().rstrip(".")
    if h.startswith("[") and h.endswith("]"):
        h = h[1:-1]
    if h in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(h.split("%", 1)[0]).is_loopback
    except ValueError:
        return False
