"""Address facts shared by every layer: which hosts are loopback, which address of this host
another host is reached through.

A leaf module (standard library only).
"""

from __future__ import annotations

import ipaddress
import socket

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


def own_host_names() -> frozenset[str]:
    """This machine's name, lower case, with and without its domain."""
    name = socket.gethostname().lower()
    return frozenset(n for n in (name, name.split(".")[0]) if n)


def host_allowed(host: str | None, own: frozenset[str]) -> bool:
    """The Host check of a server bound to loopback (against DNS rebinding): localhost, a
    loopback address, or one of ``own`` (:func:`own_host_names`); no Host header (HTTP/1.0)
    passes."""
    if host is None:
        return True
    h = host.strip().lower()
    if h.startswith("["):
        h = h[1 : h.find("]")] if "]" in h else h
    elif h.count(":") == 1:
        h = h.split(":", 1)[0]
    h = h.rstrip(".")
    return is_loopback(h) or h in own


class BindError(ValueError):
    """No address of this host can serve a given head; the message says why."""


def address_towards(head: str, port: int) -> str:
    """The address of this host that ``head`` is reached through — on the head itself, the
    address its name resolves to; a loopback ``head``: that loopback address. Raises BindError
    when ``head`` does not resolve, has no route, or resolves to a loopback address here while it
    is not a loopback name (``/etc/hosts`` mapping this host's name to 127.0.1.1: bound there, no
    other machine could connect)."""
    if is_loopback(head):
        return head.strip("[]") if head[:1].isdigit() or ":" in head else "127.0.0.1"
    try:
        infos = socket.getaddrinfo(head, port, type=socket.SOCK_DGRAM)
    except OSError as exc:
        raise BindError(f"cannot resolve {head!r} ({exc.strerror or exc})") from None
    family, _, _, _, addr = infos[0]
    # Connecting a datagram socket sends nothing: it only picks the local address of the route.
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(addr)
            local = str(probe.getsockname()[0])
        except OSError as exc:
            raise BindError(f"no route from this host to {head!r} ({exc.strerror or exc})") from None
    if is_loopback(local):
        raise BindError(
            f"{head!r} resolves to the loopback address {local} on this host, which the other machines cannot reach"
        )
    return local
